"""Launch helpers: Horovod and torch's elastic agent from a notebook or script (fork launching of
DDP lives in the DDP strategy)."""

from lightning_dist.launch.elastic_run import run_elastic
from lightning_dist.launch.horovod_run import init_gloo_beside_horovod, run_horovod

__all__ = ["init_gloo_beside_horovod", "run_elastic", "run_horovod"]
