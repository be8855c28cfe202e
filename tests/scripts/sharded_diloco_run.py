"""Fit with ShardedDiLoCo and Sharded several times, one after another, in one job (4 ranks: 2x2).

python tests/scripts/sharded_diloco_run.py --out DIR --devices N --runs JSON

JSON is a list of runs; each has a ``name`` and any of: ``strategy`` ("sharded_diloco", "sharded"),
``options`` (its keyword arguments), ``model``, ``optimizer``, ``lr``, ``steps`` or ``epochs`` with
``batches_per_epoch`` (as tests/scripts/sharded_run.py), ``save`` (a checkpoint written after
fitting, or with ``save_at_epoch`` at the end of that epoch inside ``fit``, where the rank's weights
and facts are also written as those of a run named ``snapshot_as``), ``resume`` (fit from this
checkpoint), ``checkpoint`` (a ``ModelCheckpoint(save_last=True, **checkpoint)`` writing to
``<out>/<name>/``).

Every rank writes ``<name>.rank<r>.pt`` (its replica group's full weights, gathered over the shard
group; ``"initial"``: the weights before fitting; with ``save`` or ``checkpoint`` also ``"anchors"``:
the full last-sync weights) and ``<name>.rank<r>.json``
(steps, the strategy's sync counters and bytes, the largest pseudo-gradient element of each sync,
this rank's shard size, ShardedDiLoCo's and Sharded's warnings).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from run_options import fit_each_run, trainer_length
from sharded_run import full_weights, make_model
from torch.distributed.tensor import DTensor

import lightning_dist
from lightning_dist.strategies.sharded import Sharded
from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo, like_param, local_shard
from lightning_dist.workload.trainer import quiet_trainer


class Recorded(ShardedDiLoCo):
    """ShardedDiLoCo noting the largest |pseudo-gradient| element of this rank at each sync (the
    int8 test's bound is in those)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.delta_absmax: list[float] = []

    def sync(self) -> None:
        assert self.outer is not None
        self.delta_absmax.append(
            max(float(d.abs().max()) for d in self.outer.pseudo_gradients() if d.numel())
        )
        super().sync()


def anchors(strategy: ShardedDiLoCo) -> dict[str, torch.Tensor]:
    """The full last-sync weights (gathered over the shard group: a collective)."""
    outer = strategy.outer
    assert outer is not None
    return {
        n: DTensor.full_tensor(like_param(a, p)).cpu()  # type: ignore[arg-type]
        for n, p, a in zip(outer.names, outer.params, outer.anchors, strict=True)
    }


def record(
    name: str,
    out: str,
    trainer: L.Trainer,
    model: L.LightningModule,
    initial: dict[str, Any],
    caught: list[Any],
    with_anchors: bool,
) -> None:
    """Write this rank's ``<name>.rank<r>.pt`` (the gathered weights, the ``initial`` ones and, with
    ``with_anchors``, the last-sync ones) and ``<name>.rank<r>.json`` (a collective: every rank calls it)."""
    s = trainer.strategy
    assert isinstance(s, Sharded)
    saved = {"weights": full_weights(model), "initial": initial}
    if isinstance(s, Recorded) and with_anchors:
        saved["anchors"] = anchors(s)
    rank = trainer.global_rank
    torch.save(saved, os.path.join(out, f"{name}.rank{rank}.pt"))
    info = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "train_loss": float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))),
        "bytes_by_op": {op: v.bytes_sent for op, v in s.replica_comm.stats.per_op.items()},
        "warnings": [str(w.message) for w in caught if "Sharded" in str(w.message)],
        "local_numel": sum(local_shard(p).numel() for p in model.parameters()),
        **{
            k: getattr(s, k, None)
            for k in ("syncs", "inner_step", "sync_bytes", "buffer_bytes", "delta_absmax")
        },
    }
    Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(info))


class SaveAtEpochEnd(L.Callback):
    """Writes the run's checkpoint at the end of epoch ``run["save_at_epoch"]``, inside fit, and this
    rank's weights and facts then as run ``run["snapshot_as"]``'s."""

    def __init__(self, run: dict[str, Any], out: str, initial: dict[str, Any]) -> None:
        self.run, self.out, self.initial = run, out, initial
        self.caught: list[Any] = []
        """The warnings of the fit so far (set to the fit's list)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.run["save_at_epoch"]:
            trainer.save_checkpoint(self.run["save"])
            record(self.run["snapshot_as"], self.out, trainer, pl_module, self.initial, self.caught, True)


def fit(run: dict[str, Any], out: str, devices: int) -> None:
    L.seed_everything(7, verbose=False)
    model = make_model(run)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    options = run.get("options", {})
    sharded = run.get("strategy", "sharded_diloco") == "sharded"
    strategy: Sharded = lightning_dist.Sharded(**options) if sharded else Recorded(**options)
    length = trainer_length(run, default_steps=6)
    callbacks: list[L.Callback] = []
    if "checkpoint" in run:
        dirpath = os.path.join(out, run["name"])
        callbacks.append(ModelCheckpoint(dirpath=dirpath, save_last=True, **run["checkpoint"]))
    save_at = SaveAtEpochEnd(run, out, initial)
    if "save_at_epoch" in run:
        callbacks.append(save_at)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        deterministic=True,
        callbacks=callbacks,
        enable_checkpointing="checkpoint" in run,
        **length,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_at.caught = caught
        trainer.fit(model, ckpt_path=run.get("resume"))
    if run.get("save") and "save_at_epoch" not in run:
        trainer.save_checkpoint(run["save"])
    with_anchors = (bool(run.get("save")) and "save_at_epoch" not in run) or "checkpoint" in run
    record(run["name"], out, trainer, model, initial, caught, with_anchors)


def main(argv: list[str] | None = None) -> None:
    fit_each_run(fit, argv)


if __name__ == "__main__":
    main()
