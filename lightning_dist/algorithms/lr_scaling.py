"""Multiplying a run's learning rates by a factor (Horovod's world-size rule, Elastic's linear rule)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def scale_learning_rates(optimizers: Iterable[Any], scheduler_configs: Iterable[Any], factor: float) -> None:
    """Multiply every param group's ``lr`` (and ``initial_lr``, which schedulers restart from) and
    every scheduler's ``base_lrs`` (and ``_last_lr``) by ``factor``, so schedulers that compute the
    rate from their base rates keep the scaling."""
    if factor == 1.0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * factor
    for config in scheduler_configs:
        scheduler = config.scheduler
        for name in ("base_lrs", "_last_lr"):
            if isinstance(getattr(scheduler, name, None), list):
                setattr(scheduler, name, [lr * factor for lr in getattr(scheduler, name)])
