"""What a test script leaves for its test: each rank's final weights (``rank{r}.pt``) and facts (``rank{r}.json``)."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L
import torch
from torch import nn


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
