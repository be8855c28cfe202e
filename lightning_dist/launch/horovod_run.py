"""Run a training function under Horovod from a notebook or script on one box (``horovod.run``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional

from lightning_dist.collectives.horovod_backend import import_horovod


def run_horovod(
    fn: Callable[..., Any],
    np: int = 2,
    *,
    use_mpi: bool = True,
    args: tuple[Any, ...] = (),
    kwargs: Optional[dict[str, Any]] = None,
    env: Optional[dict[str, str]] = None,
) -> list[Any]:
    """Start ``np`` local ranks running ``fn(*args, **kwargs)``; returns each rank's result.

    ``use_mpi=True`` (the default) is what ``HorovodAdasum`` needs; ``False`` uses Gloo. Under
    root, OpenMPI's run-as-root guard is lifted for the child processes.
    """
    if np < 1:
        raise ValueError(f"np={np} must be >= 1")
    import_horovod()  # a clear error if horovod is missing
    from horovod.runner import run

    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    for key, value in (env or {}).items():
        os.environ[key] = value
    mpi_args = "--oversubscribe --bind-to none" if use_mpi else None
    return run(
        fn,
        args=args,
        kwargs=kwargs or {},
        np=np,
        use_mpi=use_mpi,
        use_gloo=not use_mpi,
        mpi_args=mpi_args,
    )
