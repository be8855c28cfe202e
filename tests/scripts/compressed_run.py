"""Fit the tiny workload with several strategies, one after another, in one 2-process job.

python tests/scripts/compressed_run.py --out DIR --runs JSON

JSON is a list of runs; each has a ``name`` and any of: ``strategy`` ("DDP", or a compressor name
for ``Compressed``), ``options`` (its keyword arguments), ``optimizer`` ("adamw", "sgd" = plain SGD,
"sgd_momentum"), ``lr``, ``steps`` or ``epochs``, ``batches_per_epoch``, ``accumulate``, ``precision``,
``save`` (write a checkpoint here after fitting), ``resume`` (fit from this checkpoint),
``snapshot_steps`` (also write the weights after these optimizer steps, ``<name>.step<s>.rank<r>.pt``),
``drop_compressor_state`` (remove it from the checkpoint before resuming), ``validate``,
``workload`` (``WorkloadConfig`` overrides of the tiny size).
Each rank writes ``<name>.rank<r>.pt`` (final weights) and ``<name>.rank<r>.json`` (with
``step_bytes``: the gradient bytes it sent at each optimizer step, from ``last_step_stats``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import lightning as L
import torch
from rank_io import save_fitted
from run_options import resume_path, trainer_length

import lightning_dist
from lightning_dist import collectives
from lightning_dist.strategies.compressed import CHECKPOINT_KEY
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


class Model(TinyCausalLM):
    """The workload with a choice of optimizer: AdamW, plain SGD (DeMo's update is SGD on its output)."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = self.config.lr
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=lr)
        if self.optimizer_name == "sgd_momentum":
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.01)


class StepRecord(L.Callback):
    """The gradient bytes of every optimizer step, and the weights after the steps ``snapshots``."""

    def __init__(self, out: str, name: str, snapshots: list[int]) -> None:
        self.out, self.name, self.snapshots = out, name, snapshots
        self.step_bytes: list[float] = []
        self._before = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._before = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._before:
            return  # accumulating
        stats = getattr(trainer.strategy, "last_step_stats", {})
        self.step_bytes.append(stats.get("bytes_per_step", float("nan")))
        step = trainer.global_step
        if step in self.snapshots:
            weights = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            path = os.path.join(self.out, f"{self.name}.step{step}.rank{trainer.global_rank}.pt")
            torch.save(weights, path)


def make_strategy(run: dict[str, Any]) -> Any:
    name = run.get("strategy", "DDP")
    if name == "DDP":
        return lightning_dist.DDP(**run.get("options", {}))
    return lightning_dist.Compressed(name, **run.get("options", {}))


def fit(run: dict[str, Any], out: str) -> None:
    L.seed_everything(7, verbose=False)
    model = Model(
        run.get("optimizer", "adamw"),
        config=WorkloadConfig.tiny(
            seed=7, batch_size=run.get("batch_size", 8), lr=run.get("lr", 3e-3), **run.get("workload", {})
        ),
    )
    strategy = make_strategy(run)
    record = StepRecord(out, run["name"], run.get("snapshot_steps", []))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        callbacks=[record],
        **trainer_length(run, default_steps=20),
        limit_val_batches=1.0,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        deterministic=True,
    )
    ckpt = resume_path(run, "drop_compressor_state", CHECKPOINT_KEY, trainer.global_rank)
    trainer.fit(model, ckpt_path=ckpt)
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    info: dict[str, Any] = {
        "train_loss": float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))),
        "stats": getattr(trainer.strategy, "last_step_stats", {}),
        "logged_ratio": float(trainer.callback_metrics.get("compression/ratio", torch.tensor(float("nan")))),
        "hook_calls": getattr(getattr(trainer.strategy, "hook_state", None), "calls", None),
        "layout": {str(k): v for k, v in getattr(trainer.strategy.hook_state, "layout", {}).items()},
        "step_bytes": record.step_bytes,
        "warmup_steps": getattr(trainer.strategy, "warmup_steps", None),
    }
    if run.get("validate", True):
        info["val_loss"] = float(trainer.validate(model, verbose=False)[0]["val_loss"])
    save_fitted(out, trainer, model, prefix=f"{run['name']}.", **info)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--runs", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    for run in json.loads(a.runs):
        fit(run, a.out)
    collectives.shutdown()


if __name__ == "__main__":
    main()
