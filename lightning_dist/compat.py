"""Lightning's private APIs the pack uses, in one place, with the versions they were tested on.

A private name can change in any Lightning release, so every one the pack imports comes from here,
and importing the pack under a Lightning minor version outside ``TESTED`` warns once, naming the
tested range. The private attributes and methods the strategies read or override (which cannot be
re-exported) are listed in ``PRIVATE_ATTRIBUTES``; where the pack reaches into the Trainer's
internals it calls a function here, which says why no public API serves. tests/test_packaging.py
and tests/test_compat.py keep all of it true for the installed Lightning.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import lightning
from lightning.fabric.strategies.model_parallel import (
    _distributed_checkpoint_load,
    _distributed_checkpoint_save,
)
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "TESTED",
    "_IS_INTERACTIVE",
    "_METADATA_FILENAME",
    "_PATH",
    "_MultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_distributed_checkpoint_load",
    "_distributed_checkpoint_save",
    "_init_dist_connection",
    "_materialize_distributed_module",
    "_optimizers_to_device",
    "can_stop_early",
    "check_versions",
    "checkpoint_batch_progress",
    "disable_distributed_sampler",
    "fit_batches_started",
    "last_batch_of_epoch",
    "mark_last_batch",
    "restore_on_fit",
    "set_checkpoint_loader_state",
    "tested_range",
]

TESTED: dict[str, tuple[str, ...]] = {
    "python": ("3.11",),
    "torch": ("2.11", "2.13"),
    "lightning": ("2.6",),
    "torchmetrics": ("1.9",),
}
"""Minor versions the test suite ran on: CI (python 3.11, torch 2.13.0+cpu, lightning 2.6.6,
torchmetrics 1.9.0) and the GPU checks (torch 2.11+cu130). Pins in pyproject.toml match."""

PRIVATE_ATTRIBUTES: tuple[str, ...] = (
    "DDPStrategy._register_ddp_hooks",  # overridden: Lightning registers comm hooks on CUDA only
    "DDPStrategy._configure_launcher",  # overridden: fork check, no relaunch under torchrun/SLURM
    "DDPStrategy._process_group_backend",
    "DDPStrategy._get_process_group_backend",
    "DDPStrategy._start_method",
    "DDPStrategy._timeout",  # the process group timeout: DDP's init_process_group, Elastic's store
    "Strategy._launcher",
    "ModelParallelStrategy._setup_distributed",  # Sharded: the process group, before its own mesh
    "ModelParallelStrategy._device_mesh",  # Sharded: its (replicate, shard) mesh
    "ModelParallelStrategy._save_distributed_checkpoint",
    "LightningModule._device_mesh",  # what configure_model reads as self.device_mesh
    "_MultiProcessingLauncher._start_method",
    "LightningModule._trainer",
    "LightningModule._current_fx_name",
    "Trainer._accelerator_connector.use_distributed_sampler",  # disable_distributed_sampler
    "Trainer._checkpoint_connector._loaded_checkpoint",  # restore_on_fit
    "Trainer.fit_loop.epoch_loop.batch_progress.current.ready",  # fit_batches_started (private classes)
    "Trainer.fit_loop.epoch_loop.batch_progress.is_last_batch",  # last_batch_of_epoch, mark_last_batch
    "Trainer.fit_loop._can_stop_early",  # can_stop_early
)
"""Private attributes and methods of Lightning objects the strategies read or override, as paths from
the object whose class is named first (``Trainer._checkpoint_connector._loaded_checkpoint``)."""


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def tested_range(package: str) -> str:
    """``"2.6.x"`` or ``"2.11.x, 2.13.x"``: what ``TESTED`` says of ``package``."""
    return ", ".join(f"{v}.x" for v in TESTED[package])


def check_versions(warn: bool = True) -> list[str]:
    """The installed Lightning version when it is outside ``TESTED``, as a message (warned once when
    ``warn``). torch is not checked: its public API is all the pack uses."""
    problems = []
    for package, version in (("lightning", lightning.__version__),):
        if _minor(version) not in TESTED[package]:
            problems.append(
                f"lightning_dist was tested with {package} {tested_range(package)}; this is {package} "
                f"{version}. The strategies use Lightning internals (lightning_dist.compat) that may have "
                f"changed: if something breaks, install a tested version (pip install '{package}=="
                f"{TESTED[package][-1]}.*')"
            )
    if warn:
        from lightning_dist.warn import warn_once

        for message in problems:
            warn_once(message)
    return problems


# -- the Trainer's internals Elastic needs, each where no public API serves -------------------------
FIT_LOOP_CHECKPOINT_KEYS: tuple[tuple[str, ...], ...] = (
    ("loops", "fit_loop", "epoch_loop.batch_progress", "current", "ready"),
    ("loops", "fit_loop", "epoch_loop.batch_progress", "total", "ready"),
    ("loops", "fit_loop", "state_dict", "combined_loader"),
)
"""Paths into a checkpoint Lightning dumps during ``fit`` that ``checkpoint_batch_progress`` and
``set_checkpoint_loader_state`` read or write: the format of its private loop classes."""


def disable_distributed_sampler(trainer: Trainer) -> None:
    """``Trainer(use_distributed_sampler=False)`` for the run ahead: a strategy whose own sampler
    shards the data (Elastic's) turns Lightning's injection off. No public API: the flag is a
    constructor argument the user owns, and Lightning injects its DistributedSampler (rebuilding the
    user's DataLoader) before ``Strategy.process_dataloader`` sees the loader."""
    trainer._accelerator_connector.use_distributed_sampler = False


def restore_on_fit(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Have the ``fit`` being set up restore ``checkpoint`` (a loaded dict), as it restores the file
    of ``fit(ckpt_path=...)``: model, optimizers, schedulers, loops, callbacks, through the
    strategy's ``load_*`` hooks. Call it from ``Strategy.setup_environment``. No public API: the
    Trainer fixes the checkpoint path before the strategy has a process group, and Elastic chooses
    its commit after it (every rank must see the same one); with ``ckpt_path=None`` Lightning
    restores the checkpoint already loaded, which this sets (a ``ckpt_path`` the user passes wins)."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def fit_batches_started(trainer: Trainer) -> int:
    """Micro-batches the running ``fit`` epoch has started, the current one included and those before
    a resume counted (Lightning's batch progress ``ready``). No public API: the loop and progress
    classes holding it are private (``trainer.fit_loop`` is public, what it holds is not)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def last_batch_of_epoch(trainer: Trainer) -> bool:
    """Whether the training batch being run is the epoch's last (the loader is exhausted, or
    ``limit_train_batches`` is reached): what the epoch loop itself reads to end the epoch. No public
    API: the loop's progress classes are private."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch) or progress.current.ready == trainer.num_training_batches


def can_stop_early(trainer: Trainer) -> bool:
    """Whether a ``trainer.should_stop`` ends ``fit`` now (``min_epochs`` and ``min_steps`` met), as the
    fit loop decides it. No public API: the fit loop's ``_can_stop_early``."""
    return bool(trainer.fit_loop._can_stop_early)


def checkpoint_batch_progress(checkpoint: MutableMapping[str, Any]) -> dict[str, Any]:
    """The fit epoch's batch progress in a checkpoint (``{"current": {...}, "total": {...}}`` of
    ``ready``/``started``/``processed``/``completed`` counters), to edit in place."""
    progress: dict[str, Any] = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    return progress


def set_checkpoint_loader_state(checkpoint: MutableMapping[str, Any], states: list[Any]) -> None:
    """Set the training DataLoaders' states (one per loader, ``DataLoader.state_dict()``) that a
    checkpoint's fit loop hands back to them on restore."""
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] = states


def set_global_step(trainer: Trainer, step: int, logger_step: bool = False) -> None:
    """Make ``trainer.global_step`` ``step`` (with ``logger_step``, also the step loggers use, which
    the loop advances itself after ``on_train_batch_end``): a strategy whose steps are counted
    elsewhere (FaultTolerant: torchft's committed steps; a rejoining group starts its fit at the
    quorum's step) keeps Lightning's count equal to it, so ``max_steps``, loggers and checkpoints
    agree. No public API: the counters live in the fit loop's private progress objects."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
    epoch_loop.manual_optimization.optim_step_progress.total.completed = step
    if logger_step:
        epoch_loop._batches_that_stepped = step


def mark_last_batch(trainer: Trainer) -> None:
    """Make the batch being trained the fit epoch's last, as Lightning marks the last batch of a
    loader of known length: at its end the epoch-interval schedulers step and the epoch ends. A
    strategy whose loader ends an epoch early (FaultTolerant: when the committed steps reach the
    next data epoch) calls it during that batch. No public API: the flag is the fit loop's private
    batch progress."""
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


check_versions()  # once Lightning is loaded (here, or by the registration hook if it loaded first)
