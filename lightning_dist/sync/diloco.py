"""DiLoCo's inner/outer loop as a sync part, with no layout or resilience in it: the counters, when a
sync is due (``step_done``), and the sync (``sync``): the pseudo-gradients averaged over the ``comm``
its holder names (every rank, or the ranks with the same shard) through its compressor, the outer
step, the buffers averaged over ``buffer_comm``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.algorithms.diloco_params import by_dtype, persistent_float_buffers
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import run_exchanges
from lightning_dist.compression import Compressor


def average_pseudo_gradients(
    comm: Communicator, compressor: Compressor, deltas: list[Tensor]
) -> list[Tensor]:
    """The average of ``deltas`` over ``comm``'s ranks through ``compressor`` (one exchange per
    dtype, keyed ``diloco.<dtype>``): DiLoCo's pseudo-gradients, over all ranks or (``ShardedDiLoCo``)
    over the ranks holding the same shard."""
    out: list[Optional[Tensor]] = [None] * len(deltas)
    for dtype, indices in by_dtype(deltas).items():
        ex = compressor.exchange(
            f"diloco.{dtype}",
            [deltas[i] for i in indices],
            world_size=comm.world_size,
            rank=comm.rank,
        )
        if comm.world_size == 1:
            result = ex.run_local()
        else:
            run_exchanges(comm, [[ex]]).wait()
            assert ex.result is not None
            result = ex.result
            if result[0].is_cuda:  # the exchange's kernels ran on other streams
                torch.cuda.synchronize(result[0].device)
        for i, t in zip(indices, result, strict=True):
            out[i] = t
    return [t for t in out if t is not None]


class DiLoCoSync:
    """DiLoCo's schedule and sync (module docstring); ``outer`` is None until ``start``."""

    def __init__(
        self, inner_steps: int, outer_lr: float, outer_momentum: float, nesterov: bool, sync_buffers: bool
    ) -> None:
        self.inner_steps = inner_steps
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = nesterov
        self.sync_buffers = sync_buffers
        self.outer: Optional[OuterSGD] = None
        self.inner_step = 0
        """Optimizer steps since the last sync."""
        self.syncs = 0
        """Syncs so far (over the whole run, resumed ones included)."""
        self.sync_bytes = 0
        """Bytes this rank sent for the pseudo-gradients in this process's syncs (communicator counters)."""
        self.buffer_bytes = 0
        """Bytes this rank sent for the buffers in this process's syncs."""

    def start(
        self, named: list[tuple[str, Tensor]], local: Optional[Callable[[Tensor], Tensor]] = None
    ) -> None:
        """A fit's outer state from the parameters as they are, the counters at 0 (a checkpoint's
        are loaded after)."""
        self.outer = OuterSGD(named, self.outer_lr, self.outer_momentum, self.nesterov, local=local)
        self.inner_step = self.syncs = 0
        self.sync_bytes = self.buffer_bytes = 0

    def step_done(self, ends: bool) -> bool:
        """Count an inner optimizer step; whether a sync is due: every ``inner_steps``-th, or ``ends``
        (the last step of ``fit``)."""
        self.inner_step += 1
        return self.inner_step >= self.inner_steps or ends

    def tail_due(self) -> bool:
        """Whether inner steps since the last sync are left to sync (the end of ``fit``)."""
        return self.outer is not None and self.inner_step > 0

    def sync(
        self,
        comm: Communicator,
        compressor: Compressor,
        module: Optional[nn.Module],
        buffer_comm: Communicator,
        weight: float = 1.0,
    ) -> None:
        """Average the pseudo-gradients over ``comm`` through ``compressor`` (each multiplied by
        ``weight`` first: batch shares weigh ranks by samples trained), take the outer step,
        average ``module``'s floating-point buffers over ``buffer_comm``."""
        outer = self.outer
        assert outer is not None, "DiLoCoSync.sync: start() has not run"
        stats = comm.stats
        before = stats.bytes_sent
        deltas = outer.pseudo_gradients()
        if weight != 1.0:
            deltas = [d.mul_(weight) for d in deltas]
        outer.step(average_pseudo_gradients(comm, compressor, deltas))
        middle = stats.bytes_sent
        if self.sync_buffers and module is not None:
            buffers = persistent_float_buffers(module)
            for indices in by_dtype(buffers).values():
                buffer_comm.all_reduce([buffers[i] for i in indices], "avg")
        self.sync_bytes += middle - before
        self.buffer_bytes += stats.bytes_sent - middle
        self.inner_step = 0
        self.syncs += 1
