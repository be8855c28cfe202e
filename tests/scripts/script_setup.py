"""What the test scripts do alike: read their arguments with torch on one thread (the ranks of a test
share the machine's few cores), and fit on CPU without validation, deterministically."""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch

from lightning_dist.workload.trainer import quiet_trainer


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments read from ``argv``; torch uses one thread from here on."""
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    return a


def cpu_trainer(devices: int, strategy: Any, max_steps: int, **overrides: Any) -> L.Trainer:
    """A ``quiet_trainer`` on CPU with no validation batches, deterministic; ``overrides`` are any
    other ``L.Trainer`` arguments."""
    return quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=0,
        deterministic=True,
        **overrides,
    )
