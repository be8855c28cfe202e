"""lightning_dist: distributed-training strategies for PyTorch Lightning on one collectives layer."""

from lightning_dist import collectives
from lightning_dist.compat import check_versions
from lightning_dist.fork_safety import trace_cuda_init
from lightning_dist.strategies import DDP, Compressed, DiLoCo, Elastic, ElasticDiLoCo, Horovod, HorovodAdasum

__all__ = [
    "DDP",
    "Compressed",
    "DiLoCo",
    "Elastic",
    "ElasticDiLoCo",
    "Horovod",
    "HorovodAdasum",
    "collectives",
]
__version__ = "0.2.0"

check_versions()
trace_cuda_init()  # a fork launch after CUDA's initialisation then names the call that did it
