"""DiLoCo's tail: when ``fit`` ends inside a period, the inner steps since the last sync are synced.

Every DiLoCo strategy (``DiLoCo``, ``ShardedDiLoCo``, ``ElasticDiLoCo``, ``FaultTolerantDiLoCo``) syncs
every ``inner_steps`` optimizer steps. When training ends after a number of steps that is not a
multiple of that (``max_steps``, the epochs' batches, a ``trainer.should_stop`` from ``EarlyStopping``
or ``Timer``), the ranks would end on their own local weights. The strategy then runs one more sync
over the steps since the last one, the same one a full period ends with: the ranks' averaged
pseudo-gradient of those steps, the same outer SGD step (learning rate, momentum, Nesterov), the
buffers averaged. So every rank ends, and saves, the same weights; a fit that ends at a period's end
gets nothing more.

Where the end is known the tail runs there, before anything reads the weights:
- after the optimizer step that reaches ``max_steps`` or is the last batch of the last epoch (in the
  strategy's ``optimizer_step``: before ``on_train_batch_end``, the last validation and every
  checkpoint callback);
- for a stop a callback decides (``trainer.should_stop`` where it ends ``fit``), in that hook
  (``on_train_batch_end``, ``on_validation_end``, ``on_train_epoch_end``) by ``TailSync``, which sits
  just before the ``ModelCheckpoint`` callbacks (Lightning runs those last) and the strategy's own
  (commits);
- otherwise at the latest in ``on_train_end``, before ``ModelCheckpoint``'s ``save_last`` and the
  strategy's last commit.
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dist.compat import can_stop_early, last_batch_of_epoch


class TailSyncing(Protocol):
    """A DiLoCo strategy: ``sync_tail`` syncs the inner steps since the last sync, if there are any."""

    def sync_tail(self) -> None: ...


def ends_fit(trainer: L.Trainer, steps: int) -> bool:
    """Whether ``fit``'s training ends after the optimizer step that makes ``steps`` steps in all
    (asked in the strategy's ``optimizer_step``): ``max_steps`` reached, or the last batch of the last
    epoch. The same on every rank (the step count and the epoch's length are)."""
    if trainer.state.fn != TrainerFn.FITTING:
        return False
    if trainer.max_steps >= 0 and steps >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return (
        max_epochs is not None
        and max_epochs >= 0
        and trainer.current_epoch + 1 >= max_epochs
        and last_batch_of_epoch(trainer)
    )


class TailSync(L.Callback):
    """Runs ``strategy.sync_tail`` where a ``trainer.should_stop`` ends ``fit`` and at
    ``on_train_end``, before the checkpoint callbacks of the same hook (module docstring)."""

    def __init__(self, strategy: TailSyncing) -> None:
        self.strategy = strategy

    def _if_stopping(self, trainer: L.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and trainer.should_stop and can_stop_early(trainer):
            self.strategy.sync_tail()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._if_stopping(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._if_stopping(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._if_stopping(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.strategy.sync_tail()


def install_tail_sync(trainer: L.Trainer, strategy: TailSyncing) -> None:
    """Put ``TailSync(strategy)`` among ``trainer``'s callbacks, just before the first that saves
    state: a checkpoint callback or one of the strategy's own (its commits); at the end without one.
    Once per strategy."""
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if any(isinstance(c, TailSync) and c.strategy is strategy for c in callbacks):
        return
    saves = (
        i
        for i, c in enumerate(callbacks)
        if isinstance(c, Checkpoint) or getattr(c, "strategy", None) is strategy
    )
    callbacks.insert(next(saves, len(callbacks)), TailSync(strategy))
