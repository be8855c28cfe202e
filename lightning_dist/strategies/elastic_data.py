"""The training DataLoader a strategy reads by the pack's elastic data position (``Elastic``,
``FaultTolerant``): which loader it takes over, and what it needs of it."""

from __future__ import annotations

from typing import Optional

import lightning as L
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader
from typing_extensions import TypeIs


def is_training_loader(
    dataloader: object, trainer: Optional[L.Trainer], owner: str, micro: str, why: str
) -> TypeIs[DataLoader]:
    """Whether ``dataloader`` is the fit's training DataLoader, which the strategy reads by its plan
    (else it hands it on as it is); ``ValueError`` when that one has no ``batch_size`` (``micro``:
    what the batch size is, ``why``: what the strategy does instead of Lightning)."""
    if (
        trainer is None
        or trainer.state.stage != RunningStage.TRAINING
        or not isinstance(dataloader, DataLoader)
    ):
        return False
    if dataloader.batch_size is None:
        raise ValueError(
            f"{owner}: the training DataLoader must be built with batch_size= ({micro}); {owner} {why}"
        )
    return True
