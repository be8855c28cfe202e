"""Launch helpers: Horovod and torch's elastic agent from a notebook or script (fork launching of
DDP lives in the DDP strategy), and FaultTolerant's one-box launch (Lighthouse + one torchrun per
replica group)."""

from lightning_dist.launch.elastic_run import run_elastic
from lightning_dist.launch.fault_tolerant import Lighthouse, start_groups, stop_groups
from lightning_dist.launch.horovod_run import init_gloo_beside_horovod, run_horovod

__all__ = [
    "Lighthouse",
    "init_gloo_beside_horovod",
    "run_elastic",
    "run_horovod",
    "start_groups",
    "stop_groups",
]
