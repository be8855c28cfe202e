"""Fit the tiny workload with DDP or DiLoCo, several runs one after another, in one 2-process job.

python tests/scripts/diloco_run.py --out DIR --runs JSON

JSON is a list of runs; each has a ``name`` and any of: ``strategy`` ("DDP" or "DiLoCo"), ``options``
(its keyword arguments), ``optimizer`` ("adamw", "sgd" = plain SGD), ``lr``, ``steps`` or ``epochs``,
``batches_per_epoch``, ``accumulate``, ``precision``, ``buffer`` (add a float buffer each rank
updates from its own batches), ``save`` (a checkpoint path, written after
fitting, or with ``save_at_epoch`` at the end of that epoch inside ``fit``, with the strategy's
``checkpoint_entry()`` beside it), ``resume`` (fit from this checkpoint), ``record_batches`` (save the
batches this rank trained on), ``drop_diloco_state`` (remove DiLoCo's entry from the checkpoint before
resuming), ``validate``, ``checkpoint`` (a ``ModelCheckpoint(save_last=True, **checkpoint)`` writing to
``<out>/<name>/``), ``stop_at`` (a callback sets ``trainer.should_stop`` after that optimizer step),
``record_tail`` (save what a sync of fewer than ``inner_steps`` steps starts from), ``record_step_bytes``
(the bytes this rank sent in each optimizer step, from the collectives counters, in the JSON);
``strategy`` may also be "legacy": DiLoCo whose sync is the whole-model one of before Streaming
DiLoCo, written out here (the reference of ``fragments=1``).
``--devices N``: ranks (default 2).
Each rank writes ``<name>.rank<r>.pt`` (final weights), ``<name>.rank<r>.json`` (facts: steps, the
strategy's sync counters, the collectives counters) and, when asked, ``<name>.rank<r>.batches.pt`` and
``<name>.rank<r>.tail.pt`` (this rank's weights and the outer state before the tail sync).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rank_io import RecordBatches, save_fitted
from run_options import fit_each_run, resume_path, trainer_length

import lightning_dist
from lightning_dist.algorithms.diloco_params import by_dtype, persistent_float_buffers
from lightning_dist.strategies.diloco import CHECKPOINT_KEY
from lightning_dist.sync.diloco import average_pseudo_gradients
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


class Recorded(lightning_dist.DiLoCo):
    """DiLoCo keeping what a tail sync (fewer than ``inner_steps`` steps: the end of fit) starts from:
    this rank's weights, the outer state (last-sync weights, momentum) and the steps since the sync."""

    before_tail: dict[str, Any] | None = None

    def sync(self) -> None:
        outer = self.outer
        if outer is not None and self.inner_step < self.inner_steps:
            params = {n: p.detach().clone() for n, p in zip(outer.names, outer.params, strict=True)}
            self.before_tail = {"params": params, "outer": outer.state_dict(), "inner_step": self.inner_step}
        super().sync()


class Legacy(lightning_dist.DiLoCo):
    """DiLoCo with the sync as it was before the streaming options: the whole model's pseudo-gradients
    averaged, the outer step, the buffers averaged, the counters (the bitwise reference of P=1)."""

    def sync(self) -> None:
        outer = self.outer
        assert outer is not None
        comm = self.pseudo_gradient_comm()
        before = comm.stats.bytes_sent
        outer.step(average_pseudo_gradients(comm, self.compressor, outer.pseudo_gradients()))
        middle = comm.stats.bytes_sent
        if self.sync_buffers and self.lightning_module is not None:
            buffers = persistent_float_buffers(self.lightning_module)
            for indices in by_dtype(buffers).values():
                self._transport().all_reduce([buffers[i] for i in indices], "avg")
        self.sync_bytes += middle - before
        self.buffer_bytes += comm.stats.bytes_sent - middle
        self.inner_step = 0
        self.syncs += 1
        self.diloco_sync.ending = False


class StepBytes(L.Callback):
    """The bytes this rank sent in each optimizer step (the strategy's collectives counters)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._last = 0

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._last = trainer.strategy.communicator.stats.bytes_sent  # type: ignore[attr-defined]

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = trainer.strategy.communicator.stats.bytes_sent  # type: ignore[attr-defined]
        self.per_step.append(now - self._last)
        self._last = now


class SaveAtEpochEnd(L.Callback):
    """Writes ``path`` (and the strategy's ``checkpoint_entry()`` beside it, from rank 0) at the end of
    epoch ``epoch``, inside fit (on every rank: DiLoCo gathers every rank's state)."""

    def __init__(self, path: str, epoch: int) -> None:
        self.path, self.epoch = path, epoch

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            entry = trainer.strategy.checkpoint_entry()  # type: ignore[attr-defined]
            if trainer.is_global_zero:
                torch.save(entry, f"{self.path}.entry")


class StopAt(L.Callback):
    """Sets ``trainer.should_stop`` after optimizer step ``step`` (as EarlyStopping or Timer would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def fit(run: dict[str, Any], out: str, devices: int) -> None:
    L.seed_everything(7, verbose=False)
    model = Model(
        run.get("optimizer", "adamw"),
        run.get("buffer", False),
        config=WorkloadConfig.tiny(seed=7, batch_size=run.get("batch_size", 8), lr=run.get("lr", 3e-3)),
    )
    options = run.get("options", {})
    kinds = {"DDP": lightning_dist.DDP, "legacy": Legacy}
    strategy = kinds.get(run.get("strategy", ""), Recorded)(**options)
    recorder = RecordBatches()
    step_bytes = StepBytes()
    callbacks: list[L.Callback] = [recorder, step_bytes]
    if "stop_at" in run:
        callbacks.append(StopAt(run["stop_at"]))
    if "save_at_epoch" in run:
        callbacks.append(SaveAtEpochEnd(run["save"], run["save_at_epoch"]))
    if "checkpoint" in run:
        dirpath = os.path.join(out, run["name"])
        callbacks.append(ModelCheckpoint(dirpath=dirpath, save_last=True, **run["checkpoint"]))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        **trainer_length(run, default_steps=8),
        limit_val_batches=2,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing="checkpoint" in run,
    )
    ckpt = resume_path(run, "drop_diloco_state", CHECKPOINT_KEY, trainer.global_rank)
    trainer.fit(model, ckpt_path=ckpt)
    snapshot = trainer.strategy.communicator.stats.snapshot()  # made at setup: counts from zero
    if run.get("save") and "save_at_epoch" not in run:
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
    if run.get("record_step_bytes"):
        info["step_bytes"] = step_bytes.per_step
    if run.get("validate", False):
        metrics = trainer.validate(model, verbose=False)[0]
        info["val_loss"] = float(metrics["val_loss"])
        info["val_acc"] = float(metrics["val_acc"])
    if run.get("record_tail") and isinstance(s, Recorded):
        torch.save(s.before_tail, os.path.join(out, f"{run['name']}.rank{trainer.global_rank}.tail.pt"))
    if run.get("record_batches"):
        torch.save(recorder.batches, os.path.join(out, f"{run['name']}.rank{trainer.global_rank}.batches.pt"))
    save_fitted(out, trainer, model, prefix=f"{run['name']}.", **info)


def main(argv: list[str] | None = None) -> None:
    fit_each_run(fit, argv)


if __name__ == "__main__":
    main()
