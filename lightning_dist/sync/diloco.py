"""DiLoCo's inner/outer loop as a sync part, with no layout or resilience in it: the counters, when a
sync is due (``step_done``), and the sync (``sync``): the pseudo-gradients averaged over the ``comm``
its holder names (every rank, or the ranks with the same shard) through its compressor, the outer
step, the buffers averaged over ``buffer_comm``.

With ``fragments`` P > 1, ``fragment_sync_delay`` tau > 0 or ``fragment_update_alpha`` alpha > 0 it is
Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512; torchft's ``DiLoCo(model_fragments=...)``):
the parameters are cut into P contiguous fragments balanced by numel (``diloco_fragments``), one
fragment syncs every H/P inner steps in turn (fragment 0 at step H/P, fragment f at (f + 1) H/P + k H),
its pseudo-gradient taken and its exchange started tau steps before (``streaming``), and on landing
the outer step moves its last-sync parameters and the fragment becomes ``alpha * local + (1 - alpha)
* global``. Buffers are averaged when the last fragment syncs (every H steps). At the end of ``fit``
(``ending``) an exchange in flight lands without mixing and every other fragment that moved since its
sync syncs at once, so every rank ends on the same weights. P=1, tau=0, alpha=0 is DiLoCo, bitwise."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_dist.algorithms.diloco_fragments import FragmentSchedule, split_fragments
from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.algorithms.diloco_params import by_dtype, persistent_float_buffers
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.accounting import CommStats
from lightning_dist.collectives.exchanges import run_exchanges
from lightning_dist.compression import Compressor
from lightning_dist.sync.streaming import PendingExchange, exchange_key


def average_pseudo_gradients(
    comm: Communicator, compressor: Compressor, deltas: list[Tensor], fragment: tuple[int, int] = (0, 1)
) -> list[Tensor]:
    """The average of ``deltas`` over ``comm``'s ranks through ``compressor`` (one exchange per
    dtype, keyed ``diloco.<dtype>``; ``fragment`` (k, P) of Streaming DiLoCo: ``diloco.f<k>.<dtype>``
    when P > 1): DiLoCo's pseudo-gradients, over all ranks or (``ShardedDiLoCo``) over the ranks
    holding the same shard."""
    out: list[Optional[Tensor]] = [None] * len(deltas)
    for dtype, indices in by_dtype(deltas).items():
        ex = compressor.exchange(
            exchange_key(fragment[0], fragment[1], dtype),
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


CLEAN, MIXED, MOVED = "clean", "mixed", "moved"
"""A fragment's parameters: equal to its last-sync ones; mixed with them at its sync (alpha > 0);
moved by inner steps since."""


class DiLoCoSync:
    """DiLoCo's schedule and sync (module docstring); ``outer`` is None until ``start``."""

    def __init__(
        self,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        sync_buffers: bool,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        self.inner_steps = inner_steps
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = nesterov
        self.sync_buffers = sync_buffers
        self.fragments = fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.schedule = FragmentSchedule(inner_steps, fragments, fragment_sync_delay)
        self.outer: Optional[OuterSGD] = None
        self.inner_step = 0
        """Optimizer steps since the last sync (of a fragment, when streaming)."""
        self.syncs = 0
        """Syncs so far (over the whole run, resumed ones included); a fragment's is one, a tail one."""
        self.sync_bytes = 0
        """Bytes this rank sent for the pseudo-gradients in this process's syncs (communicator counters)."""
        self.buffer_bytes = 0
        """Bytes this rank sent for the buffers in this process's syncs."""
        self.ending = False
        """Set by the holder when the next ``sync`` is the end of ``fit`` (``step_done``'s ``ends``, the tail)."""
        self.weight = 1.0
        """What ``sync`` multiplies each pseudo-gradient by (its last ``weight``)."""
        self.next_fragment = 0
        """The fragment that syncs next."""
        self.states: list[str] = [CLEAN] * fragments
        self.pending: Optional[PendingExchange] = None
        self._plan: Optional[tuple[int, list[list[int]]]] = None

    @property
    def streaming(self) -> bool:
        """Whether any streaming option is off its default (checkpoints then hold ``stream_state``)."""
        return self.fragments > 1 or self.fragment_sync_delay > 0 or self.fragment_update_alpha > 0

    def start(
        self, named: list[tuple[str, Tensor]], local: Optional[Callable[[Tensor], Tensor]] = None
    ) -> None:
        """A fit's outer state from the parameters as they are, the counters at 0 (a checkpoint's
        are loaded after)."""
        self.outer = OuterSGD(named, self.outer_lr, self.outer_momentum, self.nesterov, local=local)
        self.inner_step = self.syncs = 0
        self.sync_bytes = self.buffer_bytes = 0
        self.reset_stream(moved=False)
        if self.fragments > 1:
            self.plan()  # more fragments than parameters: the ValueError at setup, not at the first sync

    def reset_stream(self, moved: bool) -> None:
        """A new period: fragment 0 next, nothing in flight, every fragment moved (``moved``: the
        parameters differ from the last-sync ones) or clean."""
        self.ending = False
        self.next_fragment = 0
        self.states = [MOVED if moved else CLEAN] * self.fragments
        self.pending = None

    def plan(self) -> list[list[int]]:
        """The fragments' parameter indices (``split_fragments`` of the outer state's parameters)."""
        outer = self.outer
        assert outer is not None, "DiLoCoSync.plan: start() has not run"
        if self._plan is None or self._plan[0] != id(outer):
            self._plan = (id(outer), split_fragments(outer.numels(), self.fragments))
        return self._plan[1]

    def step_done(self, ends: bool) -> bool:
        """Count an inner optimizer step; whether ``sync`` is due: every ``inner_steps``-th (with
        streaming every H/P-th, and tau steps before, to start its exchange), or ``ends`` (the last
        step of ``fit``)."""
        self.inner_step += 1
        self.states = [MOVED] * self.fragments
        self.ending = ends
        return ends or self.schedule.starts(self.inner_step) or self.schedule.lands(self.inner_step)

    def tail_due(self) -> bool:
        """Whether inner steps since the last sync are left to sync (the end of ``fit``)."""
        if self.outer is None:
            return False
        if not self.streaming:
            return self.inner_step > 0
        return self.pending is not None or any(s != CLEAN for s in self.states)

    def sync(
        self,
        comm: Communicator,
        compressor: Compressor,
        module: Optional[nn.Module],
        buffer_comm: Communicator,
        weight: float = 1.0,
    ) -> None:
        """What is due (``step_done``): the end of ``fit``'s sync, or a fragment exchange's start, its
        landing (average over ``comm`` through ``compressor``, outer step,
        mixing); ``module``'s floating-point buffers averaged over ``buffer_comm`` every H steps.
        Each pseudo-gradient is multiplied by ``weight`` before the average (batch shares weigh the
        ranks by the samples they trained)."""
        assert self.outer is not None, "DiLoCoSync.sync: start() has not run"
        self.weight = weight
        if not self.streaming:  # DiLoCo: the whole model now, whenever asked (the tail's too)
            self.ending = False
            self._land(comm, compressor, 0, 0.0)
            self._buffers(module, buffer_comm, comm.stats)
            self.inner_step = 0
            return
        if self.ending:
            self._finish(comm, compressor, module, buffer_comm)
            return
        if self.schedule.starts(self.inner_step):
            self._start(comm, compressor)
        if self.schedule.lands(self.inner_step):
            fragment = self.next_fragment
            self._land(comm, compressor, fragment, self.fragment_update_alpha)
            if fragment == self.fragments - 1:
                self._buffers(module, buffer_comm, comm.stats)
            self.next_fragment = (fragment + 1) % self.fragments
            self.inner_step = 0

    # -- the steps of a sync --------------------------------------------------------------------------
    def _start(self, comm: Communicator, compressor: Compressor) -> None:
        """Take the next fragment's pseudo-gradients and post its exchange's first round."""
        outer = self.outer
        assert outer is not None and self.pending is None
        f = self.next_fragment
        deltas = self._weighted(outer.pseudo_gradients(self.plan()[f]))
        self.pending = PendingExchange(f, self.fragments, comm, compressor, deltas)
        self.sync_bytes += self.pending.sent

    def _land(self, comm: Communicator, compressor: Compressor, fragment: int, alpha: float) -> None:
        """Fragment ``fragment``'s sync: its average (the one in flight, or one now), the outer step on
        its last-sync parameters, the fragment set to them (alpha 0) or mixed with its local ones."""
        outer = self.outer
        assert outer is not None
        indices = None if self.fragments == 1 else self.plan()[fragment]
        pending, self.pending = self.pending, None
        if pending is not None:
            assert pending.fragment == fragment, (pending.fragment, fragment)
            before = pending.sent
            averaged = pending.land(comm)
            self.sync_bytes += pending.sent - before
        else:
            before = comm.stats.bytes_sent
            averaged = average_pseudo_gradients(
                comm, compressor, self._weighted(outer.pseudo_gradients(indices)), (fragment, self.fragments)
            )
            self.sync_bytes += comm.stats.bytes_sent - before
        if alpha > 0:
            where = list(range(len(outer.params))) if indices is None else indices
            local = outer.current(where)
            outer.step(averaged, indices)
            outer.mix(local, alpha, where)
            self.states[fragment] = MIXED
        else:
            outer.step(averaged, indices)
            self.states[fragment] = CLEAN
        self.syncs += 1

    def _finish(
        self,
        comm: Communicator,
        compressor: Compressor,
        module: Optional[nn.Module],
        buffer_comm: Communicator,
    ) -> None:
        """The end of ``fit``: the exchange in flight lands without mixing, a mixed fragment takes its
        last-sync parameters, every moved one syncs (one outer step over them), the buffers averaged."""
        outer = self.outer
        assert outer is not None
        if self.pending is not None:
            self._land(comm, compressor, self.pending.fragment, 0.0)
        plan = self.plan()
        for f, state in enumerate(self.states):
            if state == MIXED:
                outer.copy_to_model(plan[f])
                self.states[f] = CLEAN
        moved = [f for f, state in enumerate(self.states) if state == MOVED]
        if moved:
            averaged: list[Tensor] = []
            indices: list[int] = []
            before = comm.stats.bytes_sent
            for f in moved:
                part = None if self.fragments == 1 else plan[f]
                averaged += average_pseudo_gradients(
                    comm, compressor, self._weighted(outer.pseudo_gradients(part)), (f, self.fragments)
                )
                indices += plan[f]
            self.sync_bytes += comm.stats.bytes_sent - before
            outer.step(averaged, None if self.fragments == 1 else indices)
            self.syncs += 1
        self._buffers(module, buffer_comm, comm.stats)
        self.reset_stream(moved=False)
        self.inner_step = 0

    def _weighted(self, deltas: list[Tensor]) -> list[Tensor]:
        """``deltas`` times ``sync``'s ``weight`` (in place; they are fresh differences)."""
        return deltas if self.weight == 1.0 else [d.mul_(self.weight) for d in deltas]

    def _buffers(self, module: Optional[nn.Module], buffer_comm: Communicator, stats: CommStats) -> None:
        """Average ``module``'s floating-point buffers (bytes counted on ``stats``, the pseudo-gradient
        communicator's, as DiLoCo always has)."""
        if self.sync_buffers and module is not None:
            before = stats.bytes_sent
            buffers = persistent_float_buffers(module)
            for indices in by_dtype(buffers).values():
                buffer_comm.all_reduce([buffers[i] for i in indices], "avg")
            self.buffer_bytes += stats.bytes_sent - before

    # -- checkpoints ----------------------------------------------------------------------------------
    def stream_state(self, comm: Communicator) -> dict[str, Any]:
        """What a checkpoint keeps of the streaming schedule (on every rank, at the same step: an
        exchange in flight lands first over ``comm``): the next fragment, each fragment's state, the
        landed average of the one in flight."""
        pending = self.pending
        if pending is not None:
            before = pending.sent
            pending.land(comm)
            self.sync_bytes += pending.sent - before
        return {
            "fragments": self.fragments,
            "next_fragment": self.next_fragment,
            "states": list(self.states),
            "pending": None if pending is None else pending.state(),
        }

    def load_stream_state(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restore ``stream_state``'s (None, or another fragment count: a new period from weights that
        moved since the last sync)."""
        if state is None or state.get("fragments") != self.fragments:
            self.reset_stream(moved=True)
            return
        outer = self.outer
        assert outer is not None
        self.next_fragment = int(state["next_fragment"])
        self.states = [str(s) for s in state["states"]]
        saved = state["pending"]
        self.pending = None
        if saved is not None:
            f = int(saved["fragment"])
            anchors = [outer.anchors[i] for i in self.plan()[f]]
            averaged = [t.to(a.device, a.dtype) for t, a in zip(saved["averaged"], anchors, strict=True)]
            self.pending = PendingExchange.landed(f, averaged)
