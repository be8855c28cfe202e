"""Lightning strategies; each registers its names in Lightning's StrategyRegistry on import."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.compressed import Compressed
from lightning_dist.strategies.ddp import DDP
from lightning_dist.strategies.diloco import DiLoCo
from lightning_dist.strategies.elastic import Elastic, ElasticDiLoCo, ElasticMixin
from lightning_dist.strategies.horovod import Horovod
from lightning_dist.strategies.horovod_adasum import HorovodAdasum

for _strategy in (DDP, Compressed, DiLoCo, Elastic, ElasticDiLoCo, Horovod, HorovodAdasum):
    _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "DDP",
    "Compressed",
    "DiLoCo",
    "Elastic",
    "ElasticDiLoCo",
    "ElasticMixin",
    "Horovod",
    "HorovodAdasum",
]
