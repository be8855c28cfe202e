"""What a test script leaves for its test: each rank's final weights (``rank{r}.pt``) and facts
(``rank{r}.json``), and the batches it trained on when a reference recomputes its steps."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import torch
from torch import nn


class RecordBatches(L.Callback):
    """Keeps every training batch this rank sees (the reference recomputes each rank's local steps)."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append((batch[0].detach().cpu().clone(), batch[1].detach().cpu().clone()))


def save_rank(out: str, rank: int, model: nn.Module, info: dict[str, Any], prefix: str = "") -> None:
    os.makedirs(out, exist_ok=True)
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(weights, os.path.join(out, f"{prefix}rank{rank}.pt"))
    with open(os.path.join(out, f"{prefix}rank{rank}.json"), "w") as fh:
        json.dump(info, fh)


def save_fitted(out: str, trainer: L.Trainer, model: nn.Module, prefix: str = "", **info: Any) -> None:
    """``save_rank`` for the trainer's rank after ``fit``; the facts also get its world size and step."""
    facts = {"world_size": trainer.world_size, "global_step": trainer.global_step, **info}
    save_rank(out, trainer.global_rank, model, facts, prefix)
