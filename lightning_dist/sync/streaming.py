"""Streaming DiLoCo's overlapped exchange: a fragment's pseudo-gradient average started after one
inner step and landed ``fragment_sync_delay`` steps later.

The exchange's rounds are posted from the training thread: the first when it starts (it is in
flight over the next tau inner steps), any further ones (int8's all-gather after its all-to-all at
more than 2 ranks) when it lands; never from a transport callback, so every rank posts them at the
same place among its other collectives (the logged loss, a checkpoint's gather), whatever the
timing.
A checkpoint taken while one is in flight lands it first (``land``) and saves the average: the
numbers do not depend on when it arrives.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dist.algorithms.diloco_params import by_dtype
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import feed, start_round
from lightning_dist.compression import Compressor, Exchange


def exchange_key(fragment: int, fragments: int, dtype: torch.dtype) -> str:
    """The compressor's key of a fragment's pseudo-gradients: ``diloco.<dtype>`` with one fragment
    (DiLoCo's own), ``diloco.f<k>.<dtype>`` with several (each keeps its own compressor state)."""
    return f"diloco.{dtype}" if fragments == 1 else f"diloco.f{fragment}.{dtype}"


class PendingExchange:
    """Fragment ``fragment``'s pseudo-gradient average over ``comm``, posted round by round."""

    def __init__(
        self,
        fragment: int,
        fragments: int,
        comm: Communicator,
        compressor: Compressor,
        deltas: list[Tensor],
    ) -> None:
        self.fragment = fragment
        self.sent = 0
        """Bytes this rank sent for it so far (the communicator's counters)."""
        self._groups = list(by_dtype(deltas).values())
        self._count = len(deltas)
        self._exchanges: list[Exchange] = [
            compressor.exchange(
                exchange_key(fragment, fragments, deltas[idx[0]].dtype),
                [deltas[i] for i in idx],
                world_size=comm.world_size,
                rank=comm.rank,
            )
            for idx in self._groups
        ]
        self._future: Optional[Future] = None
        self.averaged: Optional[list[Tensor]] = None
        if comm.world_size == 1:
            self.averaged = self._gather([ex.run_local() for ex in self._exchanges])
        else:
            self.advance(comm)

    @classmethod
    def landed(cls, fragment: int, averaged: list[Tensor]) -> PendingExchange:
        """One that has landed already (restored from a checkpoint)."""
        pending = cls.__new__(cls)
        pending.fragment, pending.sent = fragment, 0
        pending._groups, pending._count, pending._exchanges = [], len(averaged), []
        pending._future, pending.averaged = None, averaged
        return pending

    def advance(self, comm: Communicator) -> None:
        """Take the round in flight (waiting for it) and post the next one; the average once none is left."""
        if self.averaged is not None:
            return
        before = comm.stats.bytes_sent
        if self._future is not None:
            feed([self._current()], comm.wait(self._future, "diloco streaming exchange"))
            self._future = None
        current = next((ex for ex in self._exchanges if ex.round is not None), None)
        if current is None:
            results = [ex.result for ex in self._exchanges]
            assert all(r is not None for r in results)
            self.averaged = self._gather([r for r in results if r is not None])
        else:
            self._future = start_round(comm, [current])
        self.sent += comm.stats.bytes_sent - before

    def land(self, comm: Communicator) -> list[Tensor]:
        """The averaged pseudo-gradients, in the order they were given (posting what is left)."""
        while self.averaged is None:
            self.advance(comm)
        return self.averaged

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it once landed: the fragment and the average (CPU copies)."""
        assert self.averaged is not None, "PendingExchange.state: land() it first"
        return {"fragment": self.fragment, "averaged": [t.detach().cpu().clone() for t in self.averaged]}

    def _current(self) -> Exchange:
        return next(ex for ex in self._exchanges if ex.round is not None)

    def _gather(self, results: list[list[Tensor]]) -> list[Tensor]:
        out: list[Optional[Tensor]] = [None] * self._count
        for idx, result in zip(self._groups, results, strict=True):
            if result and result[0].is_cuda:  # the exchange's kernels ran on other streams
                torch.cuda.synchronize(result[0].device)
            for i, t in zip(idx, result, strict=True):
                out[i] = t
        return [t for t in out if t is not None]
