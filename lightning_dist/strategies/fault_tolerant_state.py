"""The state every part of ``FaultTolerant`` shares: the engine, the data plan, the current step's
quorum and slots, and the record of committed steps (``fault_tolerant``'s module docstring)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import lightning as L
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_dist.algorithms.micro_batch_slots import GradientSum
from lightning_dist.collectives.fault_tolerant import FaultTolerantTransport
from lightning_dist.elastic.commits import CommitStore
from lightning_dist.elastic.sampler import ElasticPlan, ElasticSampler
from lightning_dist.strategies.options_resilience import FaultTolerantOptions
from lightning_dist.strategies.rank_state import TrainingStateMixin
from lightning_dist.wire.fault_tolerant_compression import CompressedGradients

logger = logging.getLogger("lightning_dist.strategies.fault_tolerant")
OWNER = "FaultTolerant"


@dataclass
class StepRecord:
    """One committed step as this group saw it: the samples it trained on and the quorum's size."""

    step: int
    indices: list[int]
    participants: int


class FaultTolerantState(TrainingStateMixin, SingleDeviceStrategy):
    """The attributes ``FaultTolerant``'s parts read and write (set before the parts run)."""

    options: FaultTolerantOptions
    checks_group_sizes: bool = True
    """Whether each new quorum's first step checks that every group has as many processes as this
    one (a collective: every group of a quorum must make it at the same point of its step)."""
    compression: Optional[CompressedGradients]
    """The compressor and its state across failures (None: no compression)."""
    verbose: bool
    """Whether torchft logs at INFO (``verbose``)."""

    def __init__(self, **base: Any) -> None:
        super().__init__(**base)
        self.store: Optional[CommitStore] = None
        self.resumed_from: Optional[int] = None
        """The step of the commit this group resumed from (None: none)."""
        self.transport: Optional[FaultTolerantTransport] = None
        self.plan: Optional[ElasticPlan] = None
        self._dataset: Any = None
        self._collate: Callable[[list[Any]], Any] = lambda samples: samples
        self._samplers: dict[int, ElasticSampler] = {}
        self._group_rank = 0
        """This process's rank in its replica group (``RANK`` under torchrun)."""
        self._group_size = 1
        """The replica group's processes (``WORLD_SIZE`` under torchrun)."""
        self._participants = 1
        self._rank: Optional[int] = None
        self._step_indices: list[int] = []
        self._queue: list[int] = []
        """The slots of the current step this process has still to train."""
        self.last_in_step = False
        """Whether the batch being trained is this process's last of its step (the step ends after it)."""
        self._step_epoch = 0
        """The data epoch of the current step."""
        self._gradients = GradientSum()
        self._hidden_schedulers: list[Any] = []
        self._trainer_devices: list[Any] = []
        self._skipping = False
        self._joined = False
        self._stepped = False
        """Whether the current step's optimizer step ran (it was committed)."""
        self._schedulers: list[dict[str, Any]] = []
        """The schedulers' states at the current step's start (restored when it is not committed)."""
        self._hyper: list[list[dict[str, Any]]] = []
        """The optimizers' param-group hyperparameters at the current step's start (likewise)."""
        self.committed: list[StepRecord] = []
        """Every step this group committed, with the samples it trained on (tests count them)."""
        self.uncommitted_steps = 0

    def _fit_trainer(self) -> L.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @property
    def slots_per_step(self) -> int:
        """``M``: micro-batches per step over all groups."""
        return 1 if self.plan is None else self.plan.accumulate

    def data_step(self) -> int:
        """The global step whose samples the current step trains, and the Trainer's ``global_step``:
        the committed steps (``FaultTolerantDiLoCo``: its inner steps)."""
        assert self.transport is not None
        return self.transport.step
