"""Compressor interface: rounds of payloads a transport aggregates, and per-key state behind them.

A compressor never talks to a transport. ``Compressor.exchange(key, tensors, world_size=W, rank=r)``
returns an ``Exchange``; whoever drives it (a DDP comm hook, ``simulate``) repeats::

    while (rnd := ex.round) is not None:
        ex.feed(<rnd.payload aggregated across ranks as rnd.kind says>)
    ex.result  # tensors shaped and typed like ``tensors``: the (compressed) average over ranks

Round kinds, and what ``feed`` expects back:
  allreduce   the payload reduced over ranks with ``rnd.op`` ("sum", or "adasum" if asked for)
  allgather   every rank's payload (equal shapes everywhere) in rank order: a list or stacked tensor
  all_to_all  the payload has shape [W, ...] and row j goes to rank j; feed the rows received, row i
              from rank i (a list or stacked tensor)

Each round is one tensor, so a driver makes exactly one collective per round. Payloads are fresh
tensors that the driver may reduce in place. Bytes are counted by the wire model in ``wire``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, TypeVar, Union

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import build_config, check_int
from lightning_dist.compression.packing import pack, specs_of, unpack
from lightning_dist.compression.wire import (
    Shape,
    all_gather_bytes,
    all_to_all_bytes,
    reference_bytes,
    ring_all_reduce_bytes,
)

Key = Union[int, str]
RoundKind = Literal["allreduce", "allgather", "all_to_all"]
Aggregation = Literal["allreduce", "allgather", "all_to_all"]
Rounds = Generator["Round", Tensor, list[Tensor]]
"""A compressor's side of an exchange: yields rounds, is sent their aggregates, returns the result."""
T = TypeVar("T")


# -- rounds and exchanges -----------------------------------------------------------------------
@dataclass
class Round:
    """One collective: ``payload`` aggregated across ranks as ``kind`` says."""

    kind: RoundKind
    payload: Tensor
    op: Literal["sum", "adasum"] = "sum"

    def nbytes(self) -> int:
        """Bytes of this rank's payload."""
        return self.payload.numel() * self.payload.element_size()

    def wire_bytes(self, world_size: int) -> int:
        """Bytes this rank sends for the round (for ``op="adasum"``: the ring estimate)."""
        n = self.nbytes()
        if self.kind == "allreduce":
            return ring_all_reduce_bytes(n, world_size)
        if self.kind == "allgather":
            return all_gather_bytes(n, world_size)
        return all_to_all_bytes(n, world_size)


def packed_round(kind: RoundKind, parts: Sequence[Tensor]) -> Rounds:
    """One round carrying ``pack(parts)``; returns what came back, unpacked into the same segments
    (with a leading rank dimension for allgather and all_to_all). Use with ``yield from``."""
    received = yield Round(kind, pack(parts))
    return unpack(received, specs_of(parts))


class Exchange:
    """One call's trip through a compressor: the rounds still to run, then ``result``."""

    def __init__(self, rounds: Rounds, world_size: int) -> None:
        self._rounds = rounds
        self.world_size = world_size
        self.round: Optional[Round] = None
        self.result: Optional[list[Tensor]] = None
        self.wire_bytes = 0
        """Bytes this rank has sent so far, by the wire model."""
        self.num_rounds = 0
        self._advance(None)

    @property
    def done(self) -> bool:
        """Whether every round has run (``result`` is set)."""
        return self.round is None

    def _advance(self, received: Optional[Tensor]) -> None:
        try:
            rnd = next(self._rounds) if received is None else self._rounds.send(received)
        except StopIteration as stop:
            self.round = None
            self.result = stop.value
            return
        self.round = rnd
        self.num_rounds += 1
        self.wire_bytes += rnd.wire_bytes(self.world_size)

    def feed(self, received: Union[Tensor, Sequence[Tensor]]) -> None:
        """Hand back the aggregated payload of the current round (see the module docstring)."""
        rnd = self.round
        if rnd is None:
            raise RuntimeError("feed: this exchange is finished; read .result")
        if isinstance(received, Tensor):
            value = received
        else:
            if rnd.kind == "allreduce":
                raise ValueError("feed: an allreduce round takes the reduced tensor, not a list")
            value = torch.stack(list(received))
        if rnd.kind != "allreduce" and value.shape[0] != self.world_size:
            raise ValueError(
                f"feed: a {rnd.kind} round needs one row per rank ({self.world_size}), got {value.shape[0]}"
            )
        self._advance(value)

    def run_local(self) -> list[Tensor]:
        """Finish as the only rank (world size 1): every collective is the identity."""
        if self.world_size != 1:
            raise RuntimeError(
                f"run_local: this exchange was started for world size {self.world_size}; run_local finishes "
                "one started with world_size=1 only: drive it with run_exchanges over a Communicator (or "
                "simulate, in one process)"
            )
        while self.round is not None:
            p = self.round.payload
            self.feed(p.unsqueeze(0) if self.round.kind == "allgather" else p)
        assert self.result is not None
        return self.result


def simulate(exchanges: Sequence[Exchange]) -> list[list[Tensor]]:
    """Drive one exchange per rank (index = rank) in lockstep, aggregating in process."""
    if any(ex.world_size != len(exchanges) for ex in exchanges):
        raise ValueError(f"simulate: every exchange must be started with world_size={len(exchanges)}")
    while True:
        rounds = [ex.round for ex in exchanges]
        if all(r is None for r in rounds):
            break
        if any(r is None for r in rounds) or len({(r.kind, r.op) for r in rounds if r is not None}) != 1:
            kinds = [None if r is None else f"{r.kind}/{r.op}" for r in rounds]
            raise RuntimeError(
                f"simulate: the ranks' next rounds differ ({kinds}, by rank; None: finished); every rank's "
                "exchange must come from the same compressor, key and tensor shapes"
            )
        kind, op = rounds[0].kind, rounds[0].op  # type: ignore[union-attr]
        payloads = [r.payload for r in rounds]  # type: ignore[union-attr]
        if kind == "allreduce":
            if op != "sum":
                raise ValueError(f"simulate: op={op!r} is not simulated; accepted: sum")
            total = payloads[0].clone()
            for p in payloads[1:]:
                total += p
            for ex in exchanges:
                ex.feed(total.clone())
        elif kind == "allgather":
            stacked = torch.stack(payloads)
            for ex in exchanges:
                ex.feed(stacked.clone())
        else:
            for j, ex in enumerate(exchanges):
                ex.feed(torch.stack([p[j] for p in payloads]))
    return [ex.result for ex in exchanges]  # type: ignore[misc]


# -- the interface ------------------------------------------------------------------------------
@dataclass
class NoOptions:
    """The config of compressors without options."""


@dataclass
class Context:
    """What an exchange knows about the world it runs in."""

    world_size: int
    rank: int
    adasum: bool


_REGISTRY: dict[str, type[Compressor]] = {}
"""Every named compressor class, in definition order (for error messages)."""


class Compressor(ABC):
    """A gradient compressor: rounds of payloads in, the averaged tensors out, state in between.

    Built from a config (an instance of ``config_class``) or from its fields as keyword options;
    either way the config checks its values and bad ones raise a ValueError naming them.

    State is kept per ``key`` (a DDP bucket index, a parameter name): plain tensors and ints, saved
    by ``state_dict`` and restored by ``load_state_dict`` so a resumed run continues exactly. When
    the shapes seen under a key change (DDP rebuilds its buckets after the first step), that key's
    tensors are dropped and start afresh; its step counter is kept.

    Non-finite gradients (fp16 loss scaling overflows) come out non-finite, so a GradScaler skips the
    step, and leave the state (residuals, momentum, factors) as it was before the step.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[Any]] = NoOptions
    """The dataclass of its options."""
    aggregation: ClassVar[Aggregation]
    """The collective its rounds use ("allreduce" compressors are Horovod-compatible)."""
    supports_adasum: ClassVar[bool] = False
    """Whether ``exchange(..., adasum=True)`` is allowed (its allreduce rounds then ask op="adasum")."""
    per_tensor: ClassVar[bool] = False
    """Whether it needs each parameter's gradient with its shape (``bucket.gradients()``); when
    False the flat bucket (``[bucket.buffer()]``) is the cheaper input, with the same result."""
    warmup_fraction: ClassVar[float] = 0.0
    """The share of training that ``Compressed(warmup="auto")`` runs uncompressed before this
    compressor starts (0: from the first step)."""

    config: Any

    def __init__(self, config: Optional[Any] = None, **options: Any) -> None:
        """Take a ``config_class`` instance, or its fields as options (``rank=4``), not both."""
        self.config = build_config(self.name, self.config_class, config, options)
        self._state: dict[Key, dict[str, Any]] = {}
        self._derived: dict[Hashable, Any] = {}

    @override
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _REGISTRY[cls.name] = cls

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def exchange(
        self,
        key: Key,
        tensors: Union[Tensor, Sequence[Tensor]],
        *,
        world_size: int = 1,
        rank: int = 0,
        adasum: bool = False,
    ) -> Exchange:
        """Start compressing ``tensors`` (one bucket) under ``key``; drive the returned exchange."""
        check_int("world_size", world_size, 1, owner=self.name)
        check_int("rank", rank, 0, world_size - 1, owner=self.name)
        if adasum and not self.supports_adasum:
            accepted = ", ".join(n for n, c in _REGISTRY.items() if c.supports_adasum)
            raise ValueError(
                f"{self.name}: adasum=True is not supported; compressors that allow it: {accepted}"
            )
        ts = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if not ts:
            raise ValueError(f"{self.name}: exchange needs at least one tensor")
        if sum(t.numel() for t in ts) == 0:
            return Exchange(_nothing_to_send(ts), world_size)
        return Exchange(self._rounds(key, ts, Context(world_size, rank, adasum)), world_size)

    @abstractmethod
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        """Yield rounds, receive their aggregates, return the averaged tensors."""

    @abstractmethod
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one rank sends to exchange one bucket of these shapes (steady state)."""

    def ratio(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> float:
        """``wire_bytes`` over a ring all-reduce of the same tensors in fp32 (nan at world size 1)."""
        ref = reference_bytes(shapes, world_size)
        return self.wire_bytes(shapes, world_size, dtype) / ref if ref else float("nan")

    def _derive(self, key: Hashable, build: Callable[[], T]) -> T:
        """A value that depends on the config and ``key`` alone (a plan, a matrix), built once."""
        value: T
        if key in self._derived:
            value = self._derived[key]
        else:
            value = self._derived[key] = build()
        return value

    # -- state ------------------------------------------------------------------------------
    def _begin_step(self, key: Key, tensors: Sequence[Tensor]) -> tuple[dict[str, Any], int]:
        """This key's state, on the tensors' device, and the number of the step that starts now.

        The state restarts (all but its step counter) when the shapes under ``key`` changed.
        """
        shapes = [list(t.shape) for t in tensors]
        st = self._state.get(key)
        if st is None or st.get("shapes") != shapes:
            step = 0 if st is None else int(st.get("step", 0))
            st = {"step": step, "shapes": shapes}
            self._state[key] = st
        device = tensors[0].device
        for name, value in list(st.items()):
            st[name] = _map_tensors(value, lambda t: t.to(device))
        step = st["step"]
        st["step"] = step + 1
        return st, step

    def state_dict(self) -> dict[str, Any]:
        """Copies of every key's state: ``{"name": ..., "keys": {key: {"step": int, ...}}}``."""
        return {
            "name": self.name,
            "keys": {k: _map_tensors(v, lambda t: t.detach().clone()) for k, v in self._state.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (copies it); fails on another compressor's state."""
        if state.get("name") != self.name:
            raise ValueError(
                f"{self.name}: load_state_dict: this state_dict is for compressor {state.get('name')!r}; "
                f"load it into make_compressor({state.get('name')!r}), or call reset() to start {self.name} afresh"
            )
        self._state = {k: _map_tensors(v, lambda t: t.detach().clone()) for k, v in state["keys"].items()}

    def merge_states(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One state for every rank of a new world size from the ``state_dict`` of each old rank.

        Floating-point tensors are averaged over the ranks (a tensor every rank holds equal, such as
        a shared warm-start factor, stays as it is); anything else comes from the first rank. For
        error feedback under averaging this keeps what is still owed exactly: the residual of the
        averaged update, mean(e_i), is the same before and after, whatever the new world size.
        Keys that not every rank holds are dropped (they start afresh).
        """
        if not states:
            raise ValueError(f"{self.name}: merge_states needs at least one state, got none")
        for state in states:
            if state.get("name") != self.name:
                raise ValueError(
                    f"{self.name}: merge_states got a state of {state.get('name')!r}; pass the "
                    f"state_dict() of every old rank's {self.name} only"
                )
        keys = [k for k in states[0]["keys"] if all(k in s["keys"] for s in states)]
        return {"name": self.name, "keys": {k: _merge_trees([s["keys"][k] for s in states]) for k in keys}}

    def reset(self) -> None:
        """Forget all state (error feedback, warm-start factors, momentum, step counters)."""
        self._state.clear()


def _nothing_to_send(tensors: list[Tensor]) -> Rounds:
    return [t.clone() for t in tensors]
    yield  # a generator with no rounds


def _merge_trees(trees: list[Any]) -> Any:
    first = trees[0]
    if isinstance(first, Tensor):
        if not first.is_floating_point() or all(torch.equal(first, t) for t in trees[1:]):
            return first.detach().clone()
        return torch.stack([t.detach() for t in trees]).mean(dim=0)
    if isinstance(first, dict):
        return {k: _merge_trees([t[k] for t in trees]) for k in first}
    if isinstance(first, list):
        return [_merge_trees([t[i] for t in trees]) for i in range(len(first))]
    return first


def _map_tensors(tree: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    return tree
