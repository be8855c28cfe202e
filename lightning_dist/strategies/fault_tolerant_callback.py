"""The callback ``FaultTolerant`` puts first in the Trainer's list: after each batch the Trainer's
``global_step`` is the committed step, the schedulers Lightning stepped are put back unless the batch
ended a committed step, and the commits are written."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from lightning_dist.compat import set_global_step
from lightning_dist.strategies.fault_tolerant_step import FaultTolerantStep


class StepCallback(L.Callback):
    """After each batch (first of the callbacks, so the user's see it done): ``trainer.global_step``
    equal to the committed step, the schedulers Lightning stepped put back unless the step was
    committed at this batch, and the commits written (every ``commit_every`` steps and at the end
    of fit)."""

    def __init__(self, strategy: FaultTolerantStep) -> None:
        self.strategy = strategy

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = self.strategy
        if strategy.transport is None:
            return
        strategy.show_schedulers()
        set_global_step(trainer, strategy.data_step())
        strategy.undo_schedulers()
        every = strategy.options.commit_every
        if strategy.last_in_step and every and strategy.transport.step % every == 0:
            strategy.write_commit()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.strategy.write_commit()


def install_step_callback(trainer: L.Trainer, strategy: FaultTolerantStep) -> None:
    """Put ``StepCallback(strategy)`` first (once): the user's callbacks see the step done."""
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(c, StepCallback) and c.strategy is strategy for c in callbacks):
        callbacks.insert(0, StepCallback(strategy))
