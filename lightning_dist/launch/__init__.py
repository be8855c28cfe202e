"""Launch helpers: Horovod from a notebook; (fork launching lives in the DDP strategy)."""

from lightning_dist.launch.horovod_run import run_horovod

__all__ = ["run_horovod"]
