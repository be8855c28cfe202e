"""Launch helpers: Horovod and torch's elastic agent from a notebook or script (fork launching of
DDP lives in the DDP strategy), and FaultTolerant's one-box launch (Lighthouse + one torchrun per
replica group)."""

from typing import TYPE_CHECKING, Any

from lightning_dist.launch.elastic_run import run_elastic
from lightning_dist.launch.horovod_run import init_gloo_beside_horovod, run_horovod

if TYPE_CHECKING:
    from lightning_dist.launch.fault_tolerant import Lighthouse, start_groups, stop_groups

_FAULT_TOLERANT = ("Lighthouse", "start_groups", "stop_groups")

__all__ = [
    "Lighthouse",
    "init_gloo_beside_horovod",
    "run_elastic",
    "run_horovod",
    "start_groups",
    "stop_groups",
]


def __getattr__(name: str) -> Any:
    """The FaultTolerant launch helpers, imported on first use (so that ``python -m
    lightning_dist.launch.fault_tolerant`` runs the module once, not after an import of it)."""
    if name in _FAULT_TOLERANT:
        from lightning_dist.launch import fault_tolerant

        return getattr(fault_tolerant, name)
    raise AttributeError(f"module 'lightning_dist.launch' has no attribute {name!r}")
