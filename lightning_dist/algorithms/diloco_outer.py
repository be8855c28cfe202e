"""DiLoCo's outer step, pure torch (no transport): the parameters held at the last sync and an SGD on them.

    outer = OuterSGD(named_params, lr=0.7, momentum=0.9, nesterov=True)
    deltas = outer.pseudo_gradients()      # last-sync params - current params, per parameter
    ... average ``deltas`` over ranks ...
    outer.step(averaged)                   # SGD (Nesterov) step on the last-sync params; copied into the model

The last-sync parameters are kept in at least float32 (a bf16 model's updates are not rounded away).
Over a sharded model (FSDP2's DTensor parameters) ``local`` maps each parameter to the tensor the
outer step works on, this rank's shard (``ShardedDiLoCo``: ``DTensor.to_local``); by default the
parameter itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor


def _outer_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class OuterSGD:
    """The parameters at the last sync (``anchors``) and ``torch.optim.SGD`` over them.

    Args:
        named_params: (name, parameter) of every parameter DiLoCo syncs, in a fixed order.
        lr, momentum, nesterov: the outer SGD's; Nesterov with ``momentum=0`` is plain SGD.
        local: the tensor of a parameter that the outer step reads and writes in place (called under
            ``no_grad`` at every use, so it may return a fresh view); None: the parameter.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, Tensor]],
        lr: float,
        momentum: float,
        nesterov: bool,
        local: Optional[Callable[[Tensor], Tensor]] = None,
    ) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.local = local
        with torch.no_grad():
            self.anchors = [t.detach().to(_outer_dtype(t.dtype), copy=True) for t in self.tensors()]
        self.optimizer = torch.optim.SGD(
            self.anchors, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )

    def tensors(self) -> list[Tensor]:
        """The tensors the outer step works on: ``local`` of each parameter (call under ``no_grad``)."""
        local = self.local
        return list(self.params) if local is None else [local(p) for p in self.params]

    def pseudo_gradients(self, indices: Optional[Sequence[int]] = None) -> list[Tensor]:
        """last-sync params - current params (this rank's outer gradient), in the anchors' dtype; of
        the parameters at ``indices`` only (a Streaming DiLoCo fragment) when given."""
        pairs = self._pick(list(zip(self.anchors, self.tensors(), strict=True)), indices)
        with torch.no_grad():
            return [a - p.detach().to(a.dtype) for a, p in pairs]

    def step(self, averaged: Sequence[Tensor], indices: Optional[Sequence[int]] = None) -> None:
        """One outer SGD step with the ranks' averaged pseudo-gradients (of the parameters at
        ``indices`` when given: the others and their momentum stay); the model takes the result."""
        with torch.no_grad():
            for a, g in zip(self._pick(self.anchors, indices), averaged, strict=True):
                a.grad = g.to(a.dtype)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.copy_to_model(indices)

    def copy_to_model(self, indices: Optional[Sequence[int]] = None) -> None:
        """Set the model's parameters (those at ``indices`` when given) to the last-sync ones."""
        with torch.no_grad():
            for p, a in self._pick(list(zip(self.tensors(), self.anchors, strict=True)), indices):
                p.copy_(a)

    def current(self, indices: Sequence[int]) -> list[Tensor]:
        """Copies of the parameters at ``indices`` as they are, in the anchors' dtype."""
        with torch.no_grad():
            pairs = self._pick(list(zip(self.tensors(), self.anchors, strict=True)), indices)
            return [p.detach().to(a.dtype, copy=True) for p, a in pairs]

    def mix(self, local: Sequence[Tensor], alpha: float, indices: Sequence[int]) -> None:
        """Streaming DiLoCo's merge: the parameters at ``indices`` become ``alpha * local + (1 - alpha)
        * last-sync`` (``local``: their values before the outer step, in the anchors' dtype)."""
        with torch.no_grad():
            pairs = self._pick(list(zip(self.tensors(), self.anchors, strict=True)), indices)
            for (p, a), x in zip(pairs, local, strict=True):
                p.copy_(torch.lerp(a, x, alpha))

    def numels(self) -> list[int]:
        """Each parameter's (global) number of elements, in order: the same on every rank."""
        return [p.numel() for p in self.params]

    @staticmethod
    def _pick(items: list[Any], indices: Optional[Sequence[int]]) -> list[Any]:
        return items if indices is None else [items[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        """CPU copies: ``{"anchors": {name: tensor}, "momentum": {name: tensor}}`` (momentum after a step)."""
        momentum = {}
        for name, a in zip(self.names, self.anchors, strict=True):
            buf = self.optimizer.state.get(a, {}).get("momentum_buffer")
            if buf is not None:
                momentum[name] = buf.detach().cpu().clone()
        return {
            "anchors": {n: a.detach().cpu().clone() for n, a in zip(self.names, self.anchors, strict=True)},
            "momentum": momentum,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; ValueError naming what differs when the parameter
        names or shapes are not this model's."""
        anchors, momentum = state["anchors"], state["momentum"]
        problem = self._mismatch(anchors)
        if problem:
            raise ValueError(
                f"DiLoCo: the checkpoint's outer state is for other parameters than the ones the inner "
                f"optimizer steps: {problem}. Resume with the model and configure_optimizers of the run that "
                "saved it, or, to start the outer state afresh from the loaded weights, delete the "
                "checkpoint's 'lightning_dist.diloco' entry (its per-rank states go with it)"
            )
        with torch.no_grad():
            for name, a in zip(self.names, self.anchors, strict=True):
                a.copy_(anchors[name])
                self.optimizer.state.pop(a, None)
                if name in momentum:
                    self.optimizer.state[a] = {
                        "momentum_buffer": momentum[name].to(a.device, a.dtype).clone()
                    }

    def _mismatch(self, anchors: Mapping[str, Any]) -> str:
        """What differs between a checkpoint's anchors and these parameters ("" when nothing does)."""
        problems = []
        if len(anchors) != len(self.names):
            problems.append(f"it holds {len(anchors)} parameters, this model's optimizer {len(self.names)}")
        missing = [n for n in self.names if n not in anchors]
        extra = [n for n in anchors if n not in set(self.names)]
        if missing:
            problems.append(f"missing {_some(missing)}")
        if extra:
            problems.append(f"extra {_some(extra)} (not in this model's optimizer)")
        shapes = [
            f"{n} {tuple(anchors[n].shape)} in the checkpoint, {tuple(a.shape)} here"
            for n, a in zip(self.names, self.anchors, strict=True)
            if n in anchors and tuple(anchors[n].shape) != tuple(a.shape)
        ]
        if shapes:
            problems.append(f"other shapes: {_some(shapes)}")
        return "; ".join(problems)


def _some(items: Sequence[str], limit: int = 5) -> str:
    """``items`` joined, the first ``limit`` of them and how many more."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"
