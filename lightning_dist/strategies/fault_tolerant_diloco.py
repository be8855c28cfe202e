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

import time
from typing import Any

import lightning as L
from typing_extensions import override

from lightning_dist.algorithms.micro_batch_slots import owned_slots
from lightning_dist.collectives.fault_tolerant import state_checksum
from lightning_dist.compat import set_global_step
from lightning_dist.strategies.batch_shares import FAULT_TOLERANT_SHARES, refuse_shares
from lightning_dist.strategies.diloco_loop import build_diloco_compressor
from lightning_dist.strategies.diloco_tail import ends_fit, install_tail_sync
from lightning_dist.strategies.fault_tolerant import StepRecord, group_place
from lightning_dist.strategies.fault_tolerant_diloco_sync import DiLoCoPeriods, _copy
from lightning_dist.strategies.launch_needs import TORCHFT_ONE_PROCESS
from lightning_dist.strategies.options import option_names, reject_unknown_options
from lightning_dist.strategies.options_resilience import FaultTolerantDiLoCoOptions, FaultTolerantOptions
from lightning_dist.strategies.options_training import DiLoCoOptions

__all__ = ["FaultTolerantDiLoCo", "owned_slots"]

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

STREAMING = {"fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}
"""Streaming DiLoCo's options at their defaults: all ``FaultTolerantDiLoCo`` accepts of them."""


class FaultTolerantDiLoCo(DiLoCoPeriods):
    """DiLoCo over live-recovering replica groups (module docstring).

    Args:
        inner_steps: ``DiLoCo``'s; its other options (``outer_lr``, ``outer_momentum``, ``nesterov``,
            ``compression``, ``sync_buffers``) go in ``**options`` (``compression``: how the pseudo-gradients cross the wire: None, "none", "fp16", "bf16",
            "int8", "int4", "sparseloco"; int8's and int4's all-to-all and all-gather run on the quorum's process group, outside the
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
        refuse_shares(OWNER, options, FAULT_TOLERANT_SHARES)
        accepted = self._accepted_options()
        reject_unknown_options(OWNER, {k: v for k, v in options.items() if k not in accepted}, accepted)
        diloco = {name: options.pop(name) for name in option_names(DiLoCoOptions) if name in options}
        self.diloco = DiLoCoOptions(inner_steps=inner_steps, **diloco)  # checks them
        streamed = [f"{n}={diloco[n]!r}" for n in STREAMING if n in diloco and diloco[n] != STREAMING[n]]
        if streamed:
            raise ValueError(
                f"{OWNER}: {', '.join(streamed)} is not supported: its periods are one quorum and one "
                "all-or-nothing sync of the whole model, which staggered fragments and an exchange in flight "
                "across quorums would break; accepted: fragments=1, fragment_sync_delay=0, "
                "fragment_update_alpha=0.0 (Streaming DiLoCo runs on DiLoCo, ElasticDiLoCo and ShardedDiLoCo)"
            )
        self.recovery = FaultTolerantDiLoCoOptions(rejoin_timeout_s=rejoin_timeout_s)
        self.compressor = build_diloco_compressor(self.diloco.compression)
        super().__init__(**options)

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

    @override
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        """Start a period from ``state``, one as of a sync (a peer's, a commit's, or this group's own)."""
        self._snapshot = _copy(state)  # the optimizers may keep ``state``'s tensors and step them in place
        super()._load_state_dict(state)
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
            result = self.apply_step(optimizer, loss, model, **kwargs)
        else:
            optimizer.zero_grad(set_to_none=True)
        self._pending.append(StepRecord(self.data_step(), list(self._step_indices), self._participants))
        self.inner_step += 1
        if self.inner_step >= self.diloco.inner_steps or ends_fit(self._fit_trainer(), self.data_step()):
            self.sync()
        return result

    @override
    def undo_schedulers(self) -> None:
        """At the end of each inner step (after Lightning stepped the schedulers): ``FaultTolerant``'s
        undo after a period run again, and after a committed sync the state as of that sync is taken
        (what peers and commits get from now on)."""
        super().undo_schedulers()
        if self._synced:
            self._snapshot = self._current_state()
            self._synced = False
