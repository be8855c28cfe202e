"""What the multi-run scripts (``compressed_run.py``, ``diloco_run.py``) read alike from a run's JSON
description: how long it trains and in which precision, and the checkpoint it resumes from."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_dist import collectives


def trainer_length(run: dict[str, Any], default_steps: int) -> dict[str, Any]:
    """The ``Trainer`` arguments of ``steps`` or ``epochs``, ``batches_per_epoch``, ``accumulate`` and
    ``precision`` (``default_steps`` when the run gives neither ``steps`` nor ``epochs``)."""
    return {
        "max_steps": run.get("steps", -1 if "epochs" in run else default_steps),
        "max_epochs": run.get("epochs"),
        "limit_train_batches": run.get("batches_per_epoch", 1.0),
        "accumulate_grad_batches": run.get("accumulate", 1),
        "precision": run.get("precision", "32-true"),
    }


def resume_path(run: dict[str, Any], drop: str, key: str, rank: int) -> Optional[str]:
    """``run["resume"]``, or where ``run[drop]`` is set, this rank's copy of that checkpoint without
    its entry ``key`` (which it must hold)."""
    ckpt = run.get("resume")
    return without_entry(ckpt, key, rank) if ckpt and run.get(drop) else ckpt


def without_entry(ckpt: str, key: str, rank: int) -> str:
    """A copy of the checkpoint ``ckpt`` without its entry ``key`` (as another strategy, or an older
    version, writes it), for ``rank`` to resume from; its path."""
    loaded = torch.load(ckpt, weights_only=False)
    del loaded[key]
    copy = f"{ckpt}.dropped{rank}"
    torch.save(loaded, copy)
    return copy


def fit_each_run(fit: Callable[[dict[str, Any], str, int], None], argv: Optional[list[str]] = None) -> None:
    """The multi-run scripts' ``main``: ``--out DIR --runs JSON [--devices N]``; ``fit(run, out,
    devices)`` for each run in turn, in these processes, then the transport's shutdown."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--runs", required=True)
    p.add_argument("--devices", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    for run in json.loads(a.runs):
        fit(run, a.out, a.devices)
    collectives.shutdown()
