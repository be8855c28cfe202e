"""Run a training function under Horovod from a notebook or script on one box (``horovod.run``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
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


def init_gloo_beside_horovod(hvd: Any, timeout: timedelta = timedelta(seconds=60)) -> None:
    """Start torch.distributed's default Gloo group over Horovod's ranks (to run both side by side).

    Rank 0 opens the rendezvous store on a port the OS picks (port 0, kept open) and Horovod
    broadcasts the port, so no port is probed, released and hoped to be still free.
    """
    import torch.distributed as dist

    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        hvd.broadcast_object(store.port, root_rank=0, name="gloo_store_port")
    else:
        port = hvd.broadcast_object(None, root_rank=0, name="gloo_store_port")
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
