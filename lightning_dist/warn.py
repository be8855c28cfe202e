"""Warnings once per run, not once per rank.

    from lightning_dist.warn import warn_once
    warn_once("DiLoCo: the checkpoint ... ", stacklevel=2)        # where warnings.warn(..., stacklevel=2) was

A warning that every rank would raise alike (a checkpoint from another world size, a batch that does
not divide) is shown by global rank zero only, and an identical message from the same place is shown
once per process, as Python's "default" warning action does. Warning filters apply as usual: an
"always" filter (``pytest.warns`` sets one) shows every call, an "error" filter raises, and a change
of filters shows a message again. A warning about one rank is not for this helper: warn on that rank
with ``warnings.warn`` and name it (``f"rank {rank}: ..."``).

The rank is torch.distributed's when its default group is initialised, else the launcher's from the
environment (``RANK``: torchrun and Lightning; ``OMPI_COMM_WORLD_RANK``: mpirun/horovodrun;
``PMI_RANK``: MPICH/Intel MPI; ``HOROVOD_RANK``: horovodrun over Gloo; ``SLURM_PROCID``: srun), else
not zero where Lightning's launcher set ``LOCAL_RANK`` or ``NODE_RANK`` above 0, else 0.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

__all__ = ["RANK_VARIABLES", "global_rank", "warn_once"]

RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK", "SLURM_PROCID")
"""Environment variables holding the global rank, in the order they are read."""

_registry: dict[Any, Any] = {}
"""What ``warnings.warn_explicit`` has shown from ``warn_once`` (it clears it when the filters change)."""


def global_rank() -> int:
    """This process's global rank: torch.distributed's when initialised, else the environment's, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    # Lightning's own launcher sets only these in the processes it starts: not zero is all that counts
    local, node = (os.environ.get(v, "0").strip() for v in ("LOCAL_RANK", "NODE_RANK"))
    return max(int(local) if local.isdigit() else 0, int(node) if node.isdigit() else 0)


def warn_once(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)`` on global rank zero, once per message and place.

    ``stacklevel`` counts as ``warnings.warn``'s does from the caller: 1 names the line calling
    ``warn_once``, 2 its caller, and so on. Other ranks return without warning."""
    if global_rank() != 0:
        return
    frame = sys._getframe(1)
    for _ in range(stacklevel - 1):
        if frame.f_back is None:
            break
        frame = frame.f_back
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__", "<unknown>"),
        registry=_registry,
    )
