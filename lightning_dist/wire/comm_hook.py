"""A DDP communication hook that sends every gradient bucket through the strategy's communicator.

The hook's state carries the ``Communicator`` (as torchft's hooks carry its Manager): the strategy
sets ``state.comm`` when it registers the hook."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real types.
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives import Communicator
from lightning_dist.collectives.adasum import back_to_back


class HookState(Protocol):
    """What every hook state of the pack has: a call counter and the strategy's communicator."""

    calls: int
    comm: Optional[Communicator]


def start_call(state: HookState, hook: str) -> Communicator:
    """Count one call of ``hook`` and return the communicator the strategy set on its state."""
    state.calls += 1
    assert state.comm is not None, f"{hook}: the strategy sets state.comm when it registers the hook"
    return state.comm


@dataclass
class CollectivesHookState:
    """What the hook needs per model: the transport, the reduction and a call counter (observable
    in tests)."""

    reduce_op: str = "avg"
    calls: int = 0
    comm: Optional[Communicator] = None
    """The communicator the buckets go through (set by the strategy when it registers the hook)."""


def collectives_hook(
    state: CollectivesHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Reduce one bucket: fused for sum/avg, per parameter tensor for Adasum."""
    comm = start_call(state, "collectives_hook")
    buffer = bucket.buffer()
    if state.reduce_op != "adasum":
        return comm.all_reduce_async(buffer, state.reduce_op)
    # The gradients are views of the bucket's buffer, back to back: Adasum reduces them in place there.
    grads = bucket.gradients()
    fut = comm.all_reduce_async(grads, "adasum")

    def _write_back(f: Future) -> Tensor:  # type: ignore[type-arg]
        reduced = f.value()
        if back_to_back(reduced) is None or reduced[0].data_ptr() != buffer.data_ptr():
            torch.cat([g.reshape(-1) for g in reduced], out=buffer)
        return buffer

    return fut.then(_write_back)
