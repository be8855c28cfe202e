"""``FaultTolerantDiLoCo``: DiLoCo across replica groups on torchft; a failed group rejoins from the last sync.

    python -m lightning_dist.launch.fault_tolerant --groups 2 -- train.py
    # train.py: L.Trainer(strategy=FaultTolerantDiLoCo(inner_steps=100, replica_groups=2), max_steps=10_000)

``FaultTolerant``'s engine (torchft's Lighthouse, Manager, reconfigurable process group and live
checkpoint transport; the pack's commits and exactly-once data position) driving ``DiLoCo``'s outer
loop (``OuterSGD``, ``average_pseudo_gradients``). A *period* is ``inner_steps`` optimizer steps (the
last one of a ``fit`` that ends inside a period is its steps so far: ``diloco_tail``).

- **Inner steps.** Each inner step's global batch is ``M`` micro-batch slots of the pack's data
  position, split among the period's groups as ``FaultTolerant`` splits a step (slot j to participant
  ``j % participants``); every group steps its own inner optimizer on the mean of its own slots, with
  no communication.
- **Sync.** After ``inner_steps`` inner steps the groups sum their pseudo-gradients (last-sync
  parameters minus current ones, each weighted by its share of the period's samples: the average with
  equal shares) through the Manager's all-reduce, so a failed peer makes the sync not commit instead of
  raising; with them goes which group trained each slot, and a sync commits only when every slot was
  trained by exactly one of its groups. Only a committed sync takes the outer Nesterov step.
  Floating-point buffers are averaged with it. The quorum formed for a period is the one that syncs
  it (one quorum per period).
- **A failure inside a period.** The sync does not commit (the outer state does not move) and is run
  again: the groups that are there form quorums until the period's groups are all back (the same
  number, each group at its place), up to ``rejoin_timeout_s``. The failed group's torchrun restarts
  it; it joins that quorum and loads the state *as of the last sync* from a peer (global parameters,
  outer momentum, and that peer's inner optimizer and schedulers as they were at the sync; checked as
  ``FaultTolerant`` checks what it receives), redoes its share of the period's inner steps on the
  same samples, and joins the sync, where the others wait in the all-reduce (bounded by
  ``timeout_s``). So every sample of a committed period is trained exactly once, by the groups that
  started the period, and the others keep their inner steps. Only the rejoined group's inner
  optimizer differs from a fault-free run: it continues from its peer's (its own is lost with it).
- **Nobody back in time.** Past ``rejoin_timeout_s`` (or when the quorum places this group elsewhere)
  the groups there go back to the last sync and run the whole period again among themselves, taking
  over the missing group's slots: still exactly once, with that period's inner steps redone.
- **Commits.** The pack's ``CommitStore`` holds the state as of a sync, written every
  ``commit_every`` *syncs* and at the end of fit: the floor for a whole-job restart.

Timeouts: a rejoining group waits in the Lighthouse for the others' next quorum, at their sync, and
the others wait in the sync's all-reduce while it redoes its share: ``quorum_timeout_s`` and
``timeout_s`` must exceed the time of one period. A ``fit`` that ends inside a period (``max_steps``
not a multiple of ``inner_steps``) syncs the steps so far (``diloco_tail``), so every group ends on
the same weights and the last commit holds them. The training DataLoader is read as
``FaultTolerant`` reads it (map-style, with ``batch_size``).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.collectives.fault_tolerant import state_checksum
from lightning_dist.compat import set_global_step
from lightning_dist.strategies.diloco import (
    _by_dtype,
    _persistent_float_buffers,
    average_pseudo_gradients,
    build_diloco_compressor,
    inner_parameters,
)
from lightning_dist.strategies.diloco_tail import ends_fit, install_tail_sync
from lightning_dist.strategies.fault_tolerant import (
    FaultTolerant,
    StepRecord,
    _hyperparameters,
    group_place,
    owns_slot,
)
from lightning_dist.strategies.launch_needs import TORCHFT_ONE_PROCESS
from lightning_dist.strategies.options import (
    DiLoCoOptions,
    FaultTolerantDiLoCoOptions,
    FaultTolerantOptions,
    option_names,
    reject_unknown_options,
)

logger = logging.getLogger(__name__)
OWNER = "FaultTolerantDiLoCo"
FAULT_TOLERANT_ARGUMENTS = (
    *option_names(FaultTolerantOptions, without=("compression", "compressor")),
    "device",
    "accelerator",
    "checkpoint_io",
    "precision_plugin",
)
"""What ``FaultTolerantDiLoCo`` passes on to ``FaultTolerant`` (its gradient compression, if any, is not
DiLoCo's: ``compression`` here is the pseudo-gradients')."""


def owned_slots(slots: int, participants: int, rank: Optional[int]) -> int:
    """How many of a step's ``slots`` the quorum's participant ``rank`` computes (``owns_slot``)."""
    return sum(owns_slot(j, participants, rank) for j in range(slots))


def _copy(state: Any) -> Any:
    """A CPU copy of ``state`` that shares no tensor with it."""
    return copy.deepcopy(to_cpu(state))


class FaultTolerantDiLoCo(FaultTolerant):
    """DiLoCo over live-recovering replica groups (module docstring).

    Args:
        inner_steps: ``DiLoCo``'s; its other options (``outer_lr``, ``outer_momentum``, ``nesterov``,
            ``compression``, ``sync_buffers``) go in ``**options`` (``compression``: how the pseudo-gradients cross the wire: None, "none", "fp16", "bf16",
            "int8"; int8's all-to-all and all-gather run on the quorum's process group, outside the
            Manager's all-reduce: an error there also makes the sync not commit).
        rejoin_timeout_s: how long the groups of a sync that did not commit wait for the period's
            groups to be back in the quorum before they run the period again among themselves.
        **options: those and ``FaultTolerant``'s (``replica_groups``, ``global_batch``: per inner step,
            ``timeout_s``, ``quorum_timeout_s``, ``commit_every``: in syncs, ...).
    """

    strategy_name = "ld_fault_tolerant_diloco"
    launch_needs = TORCHFT_ONE_PROCESS
    checks_group_sizes = False
    """One process per group (``setup_environment``); and groups waiting at a sync form quorums
    outside a step's start, where no check could be made at the same point by every group."""

    def __init__(self, inner_steps: int = 500, rejoin_timeout_s: float = 60.0, **options: Any) -> None:
        accepted = self._accepted_options()
        reject_unknown_options(OWNER, {k: v for k, v in options.items() if k not in accepted}, accepted)
        diloco = {name: options.pop(name) for name in option_names(DiLoCoOptions) if name in options}
        self.diloco = DiLoCoOptions(inner_steps=inner_steps, **diloco)  # checks them
        self.recovery = FaultTolerantDiLoCoOptions(rejoin_timeout_s=rejoin_timeout_s)
        self.compressor = build_diloco_compressor(self.diloco.compression)
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

    @classmethod
    def _accepted_options(cls) -> list[str]:
        return [*option_names(DiLoCoOptions, FaultTolerantDiLoCoOptions), *FAULT_TOLERANT_ARGUMENTS]

    @override
    def setup_environment(self) -> None:
        size, _ = group_place()
        if size != 1:
            raise ValueError(
                f"{OWNER}: WORLD_SIZE={size}: {OWNER} runs one process per replica group (its inner steps and "
                "syncs are one process's; FaultTolerant takes several); accepted: WORLD_SIZE=1 "
                "(torchrun --nproc-per-node=1, --nproc-per-group 1, lightning-dist slurm --devices 1)"
            )
        super().setup_environment()

    @override
    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        self._outer()
        install_tail_sync(trainer, self)

    def _outer(self) -> OuterSGD:
        if self.outer is None:
            assert self.lightning_module is not None
            named = inner_parameters(OWNER, self.lightning_module, self.optimizers)
            options = self.diloco
            self.outer = OuterSGD(named, options.outer_lr, options.outer_momentum, options.nesterov)
        return self.outer

    # -- the state as of the last sync --------------------------------------------------------------
    @property
    def syncs(self) -> int:
        """Committed syncs (torchft's step)."""
        return 0 if self.transport is None else self.transport.step

    @override
    def data_step(self) -> int:
        """The inner step whose global batch is trained next (over the whole run): the period's start
        (the inner steps of the committed syncs) plus its inner steps so far."""
        start = self.syncs * self.diloco.inner_steps if self._period_start is None else self._period_start
        return start + self.inner_step

    @override
    def _state_dict(self) -> dict[str, Any]:
        """The state as of the last sync (what a peer sends, what a commit holds): the weights (the
        synced parameters), the inner optimizers and schedulers, and the outer state."""
        if self._snapshot is None:
            self._snapshot = self._current_state()
        return self._snapshot

    def sync_state(self) -> dict[str, Any]:
        """The state as of the last sync: what a recovering peer receives and a commit holds (CPU
        tensors; do not modify)."""
        return self._state_dict()

    def _current_state(self) -> dict[str, Any]:
        diloco = {"outer": self._outer().state_dict(), "period_start": self.data_step() - self.inner_step}
        return _copy({**super()._state_dict(), "diloco": diloco})

    @override
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """Start a period from ``state``, one as of a sync (a peer's, a commit's, or this group's own)."""
        self._snapshot = _copy(state)  # the optimizers may keep ``state``'s tensors and step them in place
        super()._load_state_dict(state)
        self._outer().load_state_dict(state["diloco"]["outer"])
        self._period_start = state["diloco"].get("period_start")
        self.inner_step = 0
        self._period = None
        self._pending = []
        self._loaded = state_checksum(state)

    # -- periods ----------------------------------------------------------------------------------
    @override
    def _begin_step(self) -> None:
        if self._period is not None:
            return  # inside a period: its quorum stands
        if self._quorum_kept:
            self._quorum_kept = False  # the quorum where a sync did not commit runs the period again
        else:
            super()._begin_step()  # the period's quorum; a (re)started group heals
        assert self.transport is not None
        if self._skipping and not self._fit_trainer().should_stop:
            self.transport.start_step()  # caught up from a commit: the quorum at its sync
            self._skipping = False
            set_global_step(self._fit_trainer(), self.data_step(), logger_step=True)
        self._participants = max(1, self.transport.participants)
        self._rank = None if self._skipping else self.transport.participant_rank
        self._period = (self._participants, self._rank)
        self._own = owned_slots(self.slots_per_step, self._participants, self._rank)
        self._state_dict()  # the first period's start is its last sync
        self._period_started = time.monotonic()
        if self._loaded is not None:
            self.starts.append((self.syncs, self._loaded))
            self._loaded = None

    @override
    def _step(self, optimizer: Any, loss: Any, model: Any, **kwargs: Any) -> Any:
        """An inner step on this group's own slots (no communication); the sync after the last."""
        self._stepped = True
        result: Any = loss
        if self._own:
            self._scale_gradients(self.slots_per_step / self._own)  # the mean over this group's samples
            result = super(FaultTolerant, self).optimizer_step(optimizer, lambda: loss, model, **kwargs)
        else:
            optimizer.zero_grad(set_to_none=True)
        self._pending.append(StepRecord(self.data_step(), list(self._step_indices), self._participants))
        self.inner_step += 1
        if self.inner_step >= self.diloco.inner_steps or ends_fit(self._fit_trainer(), self.data_step()):
            self.sync()
        return result

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
        for mine, synced in zip(_persistent_float_buffers(self.lightning_module), buffers):
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
        shortest = min(self.options.timeout_s, self.options.quorum_timeout_s)
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

    @override
    def undo_schedulers(self) -> None:
        """At the end of each inner step (after Lightning stepped the schedulers): ``FaultTolerant``'s
        undo after a period run again, and after a committed sync the state as of that sync is taken
        (what peers and commits get from now on)."""
        super().undo_schedulers()
        if self._synced:
            self._snapshot = self._current_state()
            self._synced = False

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
            buffers = [b.detach().clone() for b in _persistent_float_buffers(self.lightning_module)]
        averaged: list[Tensor] = []
        try:
            comm.all_reduce(trained_by, "sum")
            averaged = average_pseudo_gradients(comm, self.compressor, deltas)
            for indices in _by_dtype(buffers).values():
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
        self._schedulers = [c.scheduler.state_dict() for c in self._fit_trainer().lr_scheduler_configs]
        self._hyper = [[_hyperparameters(g) for g in opt.param_groups] for opt in self.optimizers]
        self._stepped = False
