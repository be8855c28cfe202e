"""``FaultTolerant(compressor=...)``: the gradient sum through a compressor, and its state across failures.

The exchange is the pack's (``Compressor.exchange`` driven by ``run_exchanges``) over the strategy's
``Communicator`` on torchft's ``ManagedBackend``, so a peer's failure in any round marks the step
uncommitted instead of raising. A compressor returns the average over the quorum's groups; times the
group count it is the sum ``FaultTolerant`` steps on, and the error-feedback residuals are what is
still owed of that sum: only their sum over the groups enters the update (for PowerSGD exactly, as
its factors are linear in the summed matrices).

State across failures:
  * shared state (warm-start factors, step counters, shapes) is the same on every group; a peer
    sends it with the model, checked like the rest (``FaultTolerant._state_dict``);
  * per-group state (``PER_GROUP``: error-feedback residuals, DeMo's local momentum): when a peer
    sends its state to ``n`` recovering groups, the sender and each of them take ``1/(n + 1)`` of the
    sender's, so the sum over the live groups is kept; the split is undone, on both sides, unless the
    healing step commits. A dead group's own share is lost (it is bounded by what that group had
    accumulated);
  * a step that is not committed leaves the compressor as it was before the step (the quorum runs it
    again); a group that resumes from a commit keeps its shared state and starts its residuals at zero
    (the commit holds only its writer's share).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dist.algorithms.cpu_state import map_tensors
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import run_exchanges
from lightning_dist.compression import COMPRESSORS, Compressor
from lightning_dist.compression.packing import unflatten

PER_GROUP = ("residual", "momentum")
"""The names of a key's state entries that are this group's own (everything else is shared)."""
KEY = "grads"
"""The compressor key of the one exchange per step (all the gradients)."""


def _map_per_group(state: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> dict[str, Any]:
    """A copy of a ``Compressor.state_dict()`` with ``fn`` applied to every per-group tensor."""
    keys = {
        key: {name: map_tensors(value, fn) if name in PER_GROUP else value for name, value in entry.items()}
        for key, entry in state["keys"].items()
    }
    return {**state, "keys": keys}


def share_of(state: dict[str, Any], shares: int) -> dict[str, Any]:
    """``state`` with its per-group tensors divided by ``shares`` (one group's part of a split)."""
    return _map_per_group(state, lambda t: t / shares if t.is_floating_point() else t.clone())


def without_residuals(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its per-group tensors zero (the shared state kept)."""
    return _map_per_group(state, torch.zeros_like)


@dataclass
class Handoff:
    """A committed transfer of compressor state between groups, as this group saw it."""

    step: int
    role: str
    """``"sent"`` (this group sent its state) or ``"received"``."""
    shares: int
    """How many groups split the sender's per-group state (the sender and its recovering peers)."""
    sent: dict[str, Any]
    """The sender's compressor state as sent (before the split)."""
    kept: dict[str, Any]
    """This group's compressor state after the split."""


class CompressedGradients:
    """The compressor of a ``FaultTolerant`` group and its per-step transaction (module docstring)."""

    def __init__(self, compressor: Compressor, adasum: bool = False, owner: str = "FaultTolerant") -> None:
        if adasum and not compressor.supports_adasum:
            allowed = ", ".join(n for n, c in COMPRESSORS.items() if c.supports_adasum)
            raise ValueError(
                f"{owner}: compressor={compressor.name!r} with reduce_op='adasum': its exchange is not one "
                f"all-reduce that Adasum can replace; accepted with reduce_op='adasum': compressor=None, "
                f"{allowed}"
            )
        self.compressor = compressor
        self.adasum = adasum
        """Whether ``reduce`` combines the groups' gradients by Adasum (``reduce_op="adasum"``)."""
        self.handoffs: list[Handoff] = []
        """Every committed handoff of compressor state to or from a peer (tests read them)."""
        self._received: Optional[tuple[dict[str, Any], int]] = None
        self._rollback: Optional[dict[str, Any]] = None
        self._handoff: Optional[Handoff] = None

    def reduce(self, comm: Communicator, grads: list[Tensor]) -> list[Tensor]:
        """The sum of ``grads`` over the quorum's groups, through the compressor; with ``adasum``:
        their Adasum, one exchange per tensor (the rule is per tensor)."""
        w = comm.world_size
        if self.adasum:
            exchanges = [
                self.compressor.exchange(f"{KEY}.{j}", [g], world_size=w, rank=comm.rank, adasum=True)
                for j, g in enumerate(grads)
            ]
            run_exchanges(comm, [[ex] for ex in exchanges]).wait()
            combined = []
            for ex in exchanges:
                assert ex.result is not None
                combined.append(ex.result[0])
            return combined
        per_tensor = self.compressor.per_tensor
        tensors = grads if per_tensor else [torch.cat([g.reshape(-1) for g in grads])]
        ex = self.compressor.exchange(KEY, tensors, world_size=w, rank=comm.rank)
        run_exchanges(comm, [[ex]]).wait()
        assert ex.result is not None
        if per_tensor:
            return [t * w for t in ex.result]
        return unflatten(ex.result[0] * w, grads)

    # -- what a peer sends and receives -----------------------------------------------------------
    def state(self, shares: int) -> dict[str, Any]:
        """What this group sends (and commits): its compressor state and how many groups split it."""
        return {"state": self.compressor.state_dict(), "shares": shares}

    def receive(self, sent: dict[str, Any]) -> None:
        """A state from a peer or a commit; applied at the next ``begin_step`` or ``from_commit``."""
        self._received = (sent["state"], int(sent["shares"]))

    def from_commit(self) -> None:
        """The state just received came from a commit: its shared state, residuals at zero."""
        if self._received is not None:
            self.compressor.load_state_dict(without_residuals(self._received[0]))
            self._received = None

    # -- the step's transaction -------------------------------------------------------------------
    def begin_step(self, step: int, recovering_peers: int) -> None:
        """At the step's start, after the quorum: take a peer's share (when this group recovered)
        or give one to each of ``recovering_peers``, and remember what to go back to."""
        self._handoff = None
        if self._received is not None:
            sent, shares = self._received
            self._received = None
            self._rollback = without_residuals(sent)
            kept = share_of(sent, shares)
            self._handoff = Handoff(step, "received", shares, sent, kept)
        else:
            current = self.compressor.state_dict()
            self._rollback = current
            if not recovering_peers:
                return
            shares = recovering_peers + 1
            kept = share_of(current, shares)
            self._handoff = Handoff(step, "sent", shares, current, kept)
        self.compressor.load_state_dict(kept)

    def end_step(self, committed: bool) -> None:
        """After the commit decision: keep the step's state, or put back the one before it."""
        if committed:
            if self._handoff is not None:
                self.handoffs.append(self._handoff)
        elif self._rollback is not None:
            self.compressor.load_state_dict(self._rollback)
        self._rollback = self._handoff = None
