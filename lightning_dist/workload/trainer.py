"""A quiet ``L.Trainer`` for scripted runs (test scripts, benchmarks, the workload's trainer)."""

from __future__ import annotations

from typing import Any

import lightning as L

QUIET: dict[str, Any] = {
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "logger": False,
}
"""What every scripted run turns off: no sanity validation, checkpoint files, progress bar, model
summary or logger; what such a run reports is what its script prints or saves."""


def quiet_trainer(**overrides: Any) -> L.Trainer:
    """A Trainer without checkpointing, progress bar, model summary, logger or sanity validation
    steps, for scripted runs; ``overrides`` are any other ``L.Trainer`` arguments (and may set one
    of those back)."""
    return L.Trainer(**{**QUIET, **overrides})
