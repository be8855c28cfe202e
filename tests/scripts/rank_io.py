"""What a test script leaves for its test: each rank's final weights (``rank{r}.pt``) and facts
(``rank{r}.json``), and the batches it trained on when a reference recomputes its steps; their command line
(``parse``) and the plain CPU Trainer most of them fit with (``cpu_trainer``)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_dist.workload.trainer import quiet_trainer


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments and ``--out`` (the folder the ranks write to), parsed; one torch thread per
    process (the ranks share the machine's cores)."""
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    return a


class RecordBatches(L.Callback):
    """Keeps every training batch this rank sees (the reference recomputes each rank's local steps)."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append((batch[0].detach().cpu().clone(), batch[1].detach().cpu().clone()))


def save_info(out: str, filename: str, info: dict[str, Any]) -> None:
    """``info`` as JSON in ``out/filename`` (a rank's facts for its test)."""
    with open(os.path.join(out, filename), "w") as fh:
        json.dump(info, fh)


def save_rank(out: str, rank: int, model: nn.Module, info: dict[str, Any], prefix: str = "") -> None:
    os.makedirs(out, exist_ok=True)
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(weights, os.path.join(out, f"{prefix}rank{rank}.pt"))
    save_info(out, f"{prefix}rank{rank}.json", info)


def save_fitted(out: str, trainer: L.Trainer, model: nn.Module, prefix: str = "", **info: Any) -> None:
    """``save_rank`` for the trainer's rank after ``fit``; the facts also get its world size and step."""
    facts = {"world_size": trainer.world_size, "global_step": trainer.global_step, **info}
    save_rank(out, trainer.global_rank, model, facts, prefix)


def cpu_trainer(devices: int, strategy: Any, max_steps: int, **kwargs: Any) -> L.Trainer:
    """A deterministic CPU Trainer of ``devices`` processes for ``max_steps`` steps that does not
    validate (``kwargs`` add Trainer arguments or override these)."""
    defaults: dict[str, Any] = dict(limit_val_batches=0, deterministic=True)
    return quiet_trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, **{**defaults, **kwargs}
    )
