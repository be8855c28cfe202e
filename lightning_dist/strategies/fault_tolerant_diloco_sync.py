"""``FaultTolerantDiLoCo``'s periods: the state every part of a period shares, and the sync that ends
one (the pseudo-gradients summed over the period's groups through the Manager, the outer step once it
commits; a sync that does not commit waits for the period's groups, else the period runs again;
``fault_tolerant_diloco``'s module docstring)."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.algorithms.diloco_params import by_dtype, inner_parameters, persistent_float_buffers
from lightning_dist.algorithms.micro_batch_slots import owns_slot
from lightning_dist.compression import Compressor
from lightning_dist.strategies.fault_tolerant import FaultTolerant, StepRecord
from lightning_dist.strategies.options_resilience import FaultTolerantDiLoCoOptions
from lightning_dist.strategies.options_training import DiLoCoOptions
from lightning_dist.sync.diloco import average_pseudo_gradients

logger = logging.getLogger("lightning_dist.strategies.fault_tolerant_diloco")
OWNER = "FaultTolerantDiLoCo"


def _copy(state: Any) -> Any:
    """A CPU copy of ``state`` that shares no tensor with it."""
    return copy.deepcopy(to_cpu(state))


class DiLoCoPeriods(FaultTolerant):
    """``FaultTolerant``'s engine, steps and data driving DiLoCo's periods: the period's state and
    its sync (module docstring). ``FaultTolerantDiLoCo`` sets ``diloco``, ``recovery`` and
    ``compressor`` before this runs."""

    diloco: DiLoCoOptions
    recovery: FaultTolerantDiLoCoOptions
    compressor: Compressor

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.outer: Optional[OuterSGD] = None
        self.inner_step = 0
        """Inner steps of the current period done."""
        self._period_start: Optional[int] = None
        """The inner step the current period started at (its global batch's index); None: syncs x
        inner_steps (every period so far had inner_steps steps: only the tail of a fit is shorter)."""
        self.failed_syncs = 0
        """Syncs this group ran that did not commit (a group of the period failed)."""
        self.periods_run_again = 0
        """Periods this group went back to the last sync for, to run them again with other groups."""
        self.starts: list[tuple[int, int]] = []
        """(sync, ``state_checksum`` of the state it loaded) for each period this group started from a
        loaded last-sync state: a peer's (recovery), a commit's, or its own (a period run again)."""
        self._snapshot: Optional[dict[str, Any]] = None
        self._loaded: Optional[int] = None
        self._period: Optional[tuple[int, Optional[int]]] = None
        """(participants, this group's rank) of the quorum that started the current period."""
        self._own = 0
        self._quorum_kept = False
        """Whether the next period starts with the current quorum (formed where a sync did not commit)."""
        self._synced = False
        self._warned = False
        self._period_started = 0.0
        self._pending: list[StepRecord] = []
        self.training_state.register("diloco", self._diloco_piece, per_rank=False, load=self._load_diloco)

    def _outer(self) -> OuterSGD:
        if self.outer is None:
            assert self.lightning_module is not None
            named = inner_parameters(OWNER, self.lightning_module, self.optimizers)
            options = self.diloco
            self.outer = OuterSGD(named, options.outer_lr, options.outer_momentum, options.nesterov)
        return self.outer

    @property
    def syncs(self) -> int:
        """Committed syncs (torchft's step)."""
        return 0 if self.transport is None else self.transport.step

    def _diloco_piece(self, checkpoint: Any) -> dict[str, Any]:
        """DiLoCo's replicated state as of now: the outer state and where the period started."""
        return {"outer": self._outer().state_dict(), "period_start": self.data_step() - self.inner_step}

    def _load_diloco(self, state: dict[str, Any]) -> None:
        self._outer().load_state_dict(state["outer"])
        self._period_start = state.get("period_start")

    def _current_state(self) -> dict[str, Any]:
        return _copy(super()._state_dict())

    def sync_tail(self) -> None:
        """Sync the period's inner steps so far, if any: the end of ``fit`` (``diloco_tail``); the
        state as of that sync is what the last commit holds."""
        if self.transport is None or self.outer is None or self._period is None or self.inner_step == 0:
            return
        self.sync()
        if self._synced:
            self._snapshot = self._current_state()
            self._synced = False

    def _scale_gradients(self, factor: float) -> None:
        assert self.lightning_module is not None
        if factor != 1:
            for p in self.lightning_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def sync(self) -> None:
        """End the period: the pseudo-gradients summed over its groups and the outer step, once that
        commits. A sync that does not commit runs again with the period's groups once they are back,
        else the period runs again (module docstring)."""
        failed = self.failed_syncs
        end = self.data_step()
        while True:
            result = self._exchange()
            if result is not None:
                break
            self.failed_syncs += 1
            logger.warning(
                "%s: the sync of period %d did not commit (a group failed); waiting up to %ss for the "
                "period's groups",
                OWNER,
                self.syncs,
                self.recovery.rejoin_timeout_s,
            )
            if not self._period_groups_back():
                self._run_period_again()
                return
        averaged, buffers = result
        self._outer().step(averaged)
        assert self.lightning_module is not None
        for mine, synced in zip(persistent_float_buffers(self.lightning_module), buffers):
            mine.copy_(synced)
        self.committed += self._pending
        self._pending = []
        self._period_start = end
        self.inner_step = 0
        self._period = None
        self._synced = True
        if failed == self.failed_syncs:  # a period without a failure: how long one takes
            self._check_timeouts(time.monotonic() - self._period_started)

    def _check_timeouts(self, period_s: float) -> None:
        """Warn once when a period takes longer than the timeouts a rejoining group needs."""
        shortest = min(self.options.timeouts.collective_s, self.options.timeouts.quorum_s)
        if period_s > shortest and not self._warned:
            self._warned = True
            logger.warning(
                "%s: a period took %.0f s, longer than timeout_s=%s or quorum_timeout_s=%s: a group that "
                "fails could not rejoin (it waits for the others' sync, they wait for its share of the "
                "period); set both above the time of a period",
                OWNER,
                period_s,
                self.options.timeout_s,
                self.options.quorum_timeout_s,
            )

    def _exchange(self) -> Optional[tuple[list[Tensor], list[Tensor]]]:
        """The period's pseudo-gradients summed over the quorum (each weighted by its group's share of
        the period's samples) and the buffers averaged, if the sync commits; None if it does not. With
        them goes each slot's number of groups that trained it: a sync commits only when that is 1 for
        every slot (the same result on every group, so all commit or none)."""
        assert self.transport is not None and self.lightning_module is not None and self._period is not None
        comm = self.transport.communicator
        slots = self.slots_per_step
        participants = comm.world_size
        weight = participants * self._own / slots  # 1 with equal shares
        deltas = self._outer().pseudo_gradients()
        if weight != 1:
            for delta in deltas:
                delta.mul_(weight)
        trained_by = torch.tensor(
            [float(owns_slot(j, *self._period)) for j in range(slots)], device=self.root_device
        )
        buffers: list[Tensor] = []
        if self.diloco.sync_buffers:
            buffers = [b.detach().clone() for b in persistent_float_buffers(self.lightning_module)]
        averaged: list[Tensor] = []
        try:
            comm.all_reduce(trained_by, "sum")
            averaged = average_pseudo_gradients(comm, self.compressor, deltas)
            for indices in by_dtype(buffers).values():
                comm.all_reduce([buffers[i] for i in indices], "avg")
            if not torch.equal(trained_by, torch.ones_like(trained_by)):
                raise ValueError(
                    f"{OWNER}: the quorum's groups trained the period's slots {trained_by.tolist()} times: "
                    "they started the period in other quorums"
                )
        except Exception as error:  # noqa: BLE001  (not committed: run again)
            self.transport.report_error(error)
        if not self.transport.commit():
            return None
        return averaged, buffers

    def _period_groups_back(self) -> bool:
        """Form quorums until the period's groups are all in one again (this group at its place).
        False when this group loaded a newer sync from a peer meanwhile, when the quorum has as many
        groups as the period but in other places, or, with fewer, past ``rejoin_timeout_s``: the
        period then runs again with that quorum."""
        assert self.transport is not None and self._period is not None
        deadline = time.monotonic() + self.recovery.rejoin_timeout_s
        while True:
            self.transport.start_step()
            if self._period is None:  # a peer had a newer sync: this group took it
                return False
            place = (max(1, self.transport.participants), self.transport.participant_rank)
            if place == self._period:
                return True
            if place[0] >= self._period[0] or time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def _run_period_again(self) -> None:
        """Back to the last sync (this group's own, unless it just loaded a peer's) to run the period
        again with the next quorum; the schedulers Lightning steps after this inner step are put back."""
        if self._period is not None:
            logger.warning(
                "%s: the groups of period %d are not back within rejoin_timeout_s=%s: running it again "
                "from the last sync with the groups there are",
                OWNER,
                self.syncs,
                self.recovery.rejoin_timeout_s,
            )
            self._load_state_dict(self._state_dict())
        self.periods_run_again += 1
        self._quorum_kept = True
        self.keep_schedulers()
        self._stepped = False
