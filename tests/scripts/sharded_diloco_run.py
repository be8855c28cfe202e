"""Fit with ShardedDiLoCo and Sharded several times, one after another, in one job (4 ranks: 2x2).

python tests/scripts/sharded_diloco_run.py --out DIR --devices N --runs JSON

JSON is a list of runs; each has a ``name`` and any of: ``strategy`` ("sharded_diloco", "sharded"),
``options`` (its keyword arguments), ``model``, ``optimizer``, ``lr``, ``steps`` or ``epochs`` with
``batches_per_epoch`` (as tests/scripts/sharded_run.py), ``save`` (a checkpoint written after
fitting), ``resume`` (fit from this checkpoint).

Every rank writes ``<name>.rank<r>.pt`` (its replica group's full weights, gathered over the shard
group; ``"initial"``: the weights before fitting; with ``save`` also ``"anchors"``: the full last-sync
weights) and ``<name>.rank<r>.json``
(steps, the strategy's sync counters and bytes, the largest pseudo-gradient element of each sync,
this rank's shard size, ShardedDiLoCo's and Sharded's warnings).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
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


def fit(run: dict[str, Any], out: str, devices: int) -> None:
    import lightning as L

    L.seed_everything(7, verbose=False)
    model = make_model(run)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    options = run.get("options", {})
    sharded = run.get("strategy", "sharded_diloco") == "sharded"
    strategy: Sharded = lightning_dist.Sharded(**options) if sharded else Recorded(**options)
    length = trainer_length(run, default_steps=6)
    trainer = quiet_trainer(
        accelerator="cpu", devices=devices, strategy=strategy, deterministic=True, **length
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    saved: dict[str, Any] = {"weights": full_weights(model), "initial": initial}
    if isinstance(strategy, Recorded) and run.get("save"):
        saved["anchors"] = anchors(strategy)
    rank = trainer.global_rank
    torch.save(saved, os.path.join(out, f"{run['name']}.rank{rank}.pt"))
    s = strategy
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
    Path(out, f"{run['name']}.rank{rank}.json").write_text(json.dumps(info))


def main(argv: list[str] | None = None) -> None:
    fit_each_run(fit, argv)


if __name__ == "__main__":
    main()
