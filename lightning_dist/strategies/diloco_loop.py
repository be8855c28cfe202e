"""``DiLoCoLoop``: a strategy's glue to the DiLoCo sync part it holds (``diloco_sync``, a
``lightning_dist.sync.diloco.DiLoCoSync``), driven from Lightning's hooks; the part's counters and
outer state read as the strategy's own (``strategy.outer``, ``strategy.inner_step``, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.collectives import Communicator
from lightning_dist.compression import COMPRESSORS, Compressor
from lightning_dist.compression.builder import build_compressor
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.diloco_tail import ends_fit, install_tail_sync
from lightning_dist.strategies.options import DILOCO_COMPRESSIONS, DILOCO_LOWBIT_COMPRESSIONS
from lightning_dist.strategies.part_field import PartField
from lightning_dist.sync.diloco import DiLoCoSync


def build_diloco_compressor(compression: Union[None, str, Compressor]) -> Compressor:
    """The compressor for ``compression`` (None: uncompressed); ValueError naming what is accepted."""
    return build_compressor(
        compression,
        COMPRESSORS,
        argument="compression",
        accepted=(*DILOCO_COMPRESSIONS, *DILOCO_LOWBIT_COMPRESSIONS),
        refusal=" by DiLoCo (the pseudo-gradient needs an average)",
    )


class DiLoCoLoop(CollectiveOpsMixin):
    """DiLoCo's loop in a strategy (module docstring), shared by ``DiLoCo`` and ``ShardedDiLoCo``. Put
    it before the strategy's base; the strategy calls ``_init_loop`` and sets ``compressor``."""

    compressor: Compressor
    diloco_sync: DiLoCoSync
    inner_steps: PartField[int] = PartField("diloco_sync")
    outer_lr: PartField[float] = PartField("diloco_sync")
    outer_momentum: PartField[float] = PartField("diloco_sync")
    nesterov: PartField[bool] = PartField("diloco_sync")
    sync_buffers: PartField[bool] = PartField("diloco_sync")
    fragments: PartField[int] = PartField("diloco_sync")
    fragment_sync_delay: PartField[int] = PartField("diloco_sync")
    fragment_update_alpha: PartField[float] = PartField("diloco_sync")
    outer: PartField[Optional[OuterSGD]] = PartField("diloco_sync")
    inner_step: PartField[int] = PartField("diloco_sync")
    syncs: PartField[int] = PartField("diloco_sync")
    sync_bytes: PartField[int] = PartField("diloco_sync")
    buffer_bytes: PartField[int] = PartField("diloco_sync")

    def _init_loop(
        self,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        sync_buffers: bool,
        streaming: tuple[int, int, float] = (1, 0, 0.0),
    ) -> None:
        """The sync part; ``streaming``: ``DiLoCoOptions.streaming`` (P, tau, alpha)."""
        self.diloco_sync = DiLoCoSync(
            inner_steps, outer_lr, outer_momentum, nesterov, sync_buffers, *streaming
        )

    def pseudo_gradient_comm(self) -> Communicator:
        """Over whom the pseudo-gradients are averaged: every rank (``DiLoCo``)."""
        return self._transport()

    @override
    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            install_tail_sync(trainer, self)

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        """The inner step; the sync after every ``inner_steps``-th, and after the last one of ``fit``
        (``diloco_tail``)."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        if self.diloco_sync.step_done(trainer is not None and ends_fit(trainer, trainer.global_step + 1)):
            self.sync()
        return result

    def sync_tail(self) -> None:
        """Sync the inner steps since the last sync, if any: the end of ``fit`` (``diloco_tail``)."""
        if self.diloco_sync.tail_due():
            self.diloco_sync.ending = True
            self.sync()

    def sync(self) -> None:
        """Average the pseudo-gradients over ranks, take the outer step, average the buffers (with
        streaming: what of a fragment's sync is due, ``DiLoCoSync.sync``)."""
        assert self.outer is not None, f"{type(self).__name__}.sync: setup() has not run"
        comm = self.pseudo_gradient_comm()
        part = getattr(self, "batch_shares", None)
        weight = 1.0 if part is None else part.period_weight(self.diloco_sync.inner_step)
        self.diloco_sync.sync(comm, self.compressor, self.lightning_module, self._transport(), weight)
