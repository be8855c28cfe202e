"""Fit the tiny workload with one strategy, save, and resume with another, in one 2-process job.

python tests/scripts/cross_resume.py --out DIR --runs JSON

JSON is a list of runs; each has a ``name``, a ``strategy`` ("sharded": ``Sharded()``, "ddp": ``DDP()``,
or a compressor name for ``Compressed``), ``options`` (the strategy's keyword arguments), ``steps`` or ``epochs`` with ``batches_per_epoch``, and
optionally ``save`` (a checkpoint written after fitting: a directory for Sharded) and ``resume`` (fit
from this checkpoint). Each rank writes ``<name>.rank<r>.pt`` (the full final weights, gathered from
the shards) and ``<name>.rank<r>.json`` (world size, global step, the pack's warnings).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning as L
import torch
from rank_io import save_info
from run_options import fit_each_run, trainer_length
from torch.distributed.tensor import DTensor

import lightning_dist
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

OWNERS = ("DDP:", "Sharded:", "Compressed:")
"""The pack's warnings recorded: those of the strategies these runs use."""


def make_strategy(name: str, options: dict[str, Any]) -> Any:
    if name == "sharded":
        return lightning_dist.Sharded(**options)
    if name == "ddp":
        return lightning_dist.DDP(**options)
    return lightning_dist.Compressed(name, **options)


def fit(run: dict[str, Any], out: str, devices: int) -> None:
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7, n_layers=2))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=make_strategy(run["strategy"], run.get("options", {})),
        **trainer_length(run, default_steps=6),
        limit_val_batches=0,
        deterministic=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    weights = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in model.state_dict().items()
    }  # a collective for the shards: every rank gathers
    rank = trainer.global_rank
    info = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "warnings": [str(w.message) for w in caught if str(w.message).startswith(OWNERS)],
    }
    torch.save(weights, os.path.join(out, f"{run['name']}.rank{rank}.pt"))
    save_info(out, f"{run['name']}.rank{rank}.json", info)


def main(argv: list[str] | None = None) -> None:
    fit_each_run(fit, argv)


if __name__ == "__main__":
    main()
