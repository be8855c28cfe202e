"""Fit the tiny workload with DDP or DiLoCo, several runs one after another, in one 2-process job.

python tests/scripts/diloco_run.py --out DIR --runs JSON

JSON is a list of runs; each has a ``name`` and any of: ``strategy`` ("DDP" or "DiLoCo"), ``options``
(its keyword arguments), ``optimizer`` ("adamw", "sgd" = plain SGD), ``lr``, ``steps`` or ``epochs``,
``batches_per_epoch``, ``accumulate``, ``precision``, ``buffer`` (add a float buffer each rank
updates from its own batches), ``save`` (a checkpoint path, written after
fitting), ``resume`` (fit from this checkpoint), ``record_batches`` (save the batches this rank
trained on), ``drop_diloco_state`` (remove DiLoCo's entry from the checkpoint before resuming),
``validate``. ``--devices N``: ranks (default 2).
Each rank writes ``<name>.rank<r>.pt`` (final weights), ``<name>.rank<r>.json`` (facts: steps, the
strategy's sync counters, the collectives counters) and, when asked, ``<name>.rank<r>.batches.pt``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from rank_io import RecordBatches, save_fitted
from run_options import fit_each_run, resume_path, trainer_length

import lightning_dist
from lightning_dist.strategies.diloco import CHECKPOINT_KEY
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


class Model(TinyCausalLM):
    """The workload with a choice of inner optimizer: AdamW (the default) or plain SGD."""

    def __init__(self, optimizer: str, buffer: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        if buffer:  # a float buffer that differs per rank: the sum of its batches' mean tokens
            self.register_buffer("token_mean_sum", torch.zeros(()))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        buffer = getattr(self, "token_mean_sum", None)
        if isinstance(buffer, torch.Tensor):
            buffer += batch[0].float().mean()
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.config.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.config.lr, weight_decay=0.01)


def fit(run: dict[str, Any], out: str, devices: int) -> None:
    L.seed_everything(7, verbose=False)
    model = Model(
        run.get("optimizer", "adamw"),
        run.get("buffer", False),
        config=WorkloadConfig.tiny(seed=7, batch_size=run.get("batch_size", 8), lr=run.get("lr", 3e-3)),
    )
    options = run.get("options", {})
    strategy = (
        lightning_dist.DDP(**options) if run.get("strategy") == "DDP" else lightning_dist.DiLoCo(**options)
    )
    recorder = RecordBatches()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        **trainer_length(run, default_steps=8),
        limit_val_batches=2,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        deterministic=True,
        callbacks=[recorder],
    )
    ckpt = resume_path(run, "drop_diloco_state", CHECKPOINT_KEY, trainer.global_rank)
    trainer.fit(model, ckpt_path=ckpt)
    snapshot = trainer.strategy.communicator.stats.snapshot()  # made at setup: counts from zero
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
        entry = trainer.strategy.checkpoint_entry()  # from the module and optimizer (a commit writer's way)
        if trainer.is_global_zero:
            torch.save(entry, f"{run['save']}.entry")
    s = trainer.strategy
    info: dict[str, Any] = {
        "train_loss": float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))),
        "comm": snapshot,
        "sync_bytes": getattr(s, "sync_bytes", None),
        "buffer_bytes": getattr(s, "buffer_bytes", None),
        "syncs": getattr(s, "syncs", None),
        "inner_step": getattr(s, "inner_step", None),
        "micro_batches": len(recorder.batches),
    }
    if run.get("validate", False):
        metrics = trainer.validate(model, verbose=False)[0]
        info["val_loss"] = float(metrics["val_loss"])
        info["val_acc"] = float(metrics["val_acc"])
    if run.get("record_batches"):
        torch.save(recorder.batches, os.path.join(out, f"{run['name']}.rank{trainer.global_rank}.batches.pt"))
    save_fitted(out, trainer, model, prefix=f"{run['name']}.", **info)


def main(argv: list[str] | None = None) -> None:
    fit_each_run(fit, argv)


if __name__ == "__main__":
    main()
