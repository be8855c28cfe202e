"""What the multi-run scripts (``compressed_run.py``, ``diloco_run.py``) read alike from a run's JSON
description: how long it trains and in which precision, and the checkpoint it resumes from."""

from __future__ import annotations

from typing import Any, Optional

import torch


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
