"""Lightning's private APIs the pack uses, in one place, with the versions they were tested on.

A private name can change in any Lightning release, so every one the pack imports comes from here,
and importing the pack under a Lightning minor version outside ``TESTED`` warns once, naming the
tested range. The private attributes and methods the strategies read or override (which cannot be
re-exported) are listed in ``PRIVATE_ATTRIBUTES``; tests/test_compat.py keeps both lists true.
"""

from __future__ import annotations

import lightning
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "TESTED",
    "_IS_INTERACTIVE",
    "_PATH",
    "_MultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_init_dist_connection",
    "check_versions",
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
    "DDPStrategy._num_nodes",
    "DDPStrategy._start_method",
    "DDPStrategy._timeout",
    "Strategy._launcher",
    "_MultiProcessingLauncher._start_method",
    "LightningModule._trainer",
    "LightningModule._current_fx_name",
    "Trainer._accelerator_connector",
    "Trainer._checkpoint_connector",
    "_CheckpointConnector._loaded_checkpoint",  # Elastic hands Lightning the commit to restore
)
"""Private attributes and methods of Lightning objects the strategies read or override."""


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
