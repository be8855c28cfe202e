"""lightning_dist: distributed-training strategies for PyTorch Lightning on one collectives layer."""

from lightning_dist import collectives
from lightning_dist.strategies import DDP, Compressed, Elastic, Horovod, HorovodAdasum

__all__ = ["DDP", "Compressed", "Elastic", "Horovod", "HorovodAdasum", "collectives"]
__version__ = "0.1.0"
