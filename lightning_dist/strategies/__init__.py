"""Lightning strategies. The classes are imported on first use (``from lightning_dist.strategies import
DDP``), so this package, its option and name tables, load without Lightning; their names are in
Lightning's ``StrategyRegistry`` once Lightning is loaded (``names.py``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dist.strategies.compressed import Compressed as Compressed
    from lightning_dist.strategies.ddp import DDP as DDP
    from lightning_dist.strategies.diloco import DiLoCo as DiLoCo
    from lightning_dist.strategies.elastic import (
        Elastic as Elastic,
    )
    from lightning_dist.strategies.elastic import (
        ElasticMixin as ElasticMixin,
    )
    from lightning_dist.strategies.elastic_diloco import ElasticDiLoCo as ElasticDiLoCo
    from lightning_dist.strategies.fault_tolerant import FaultTolerant as FaultTolerant
    from lightning_dist.strategies.fault_tolerant_diloco import FaultTolerantDiLoCo as FaultTolerantDiLoCo
    from lightning_dist.strategies.horovod import Horovod as Horovod
    from lightning_dist.strategies.horovod_adasum import HorovodAdasum as HorovodAdasum
    from lightning_dist.strategies.horovod_elastic import HorovodElastic as HorovodElastic
    from lightning_dist.strategies.sharded import Sharded as Sharded
    from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo as ShardedDiLoCo

_CLASSES = {
    "DDP": "ddp",
    "Compressed": "compressed",
    "DiLoCo": "diloco",
    "Elastic": "elastic",
    "ElasticDiLoCo": "elastic_diloco",
    "ElasticMixin": "elastic",
    "FaultTolerant": "fault_tolerant",
    "FaultTolerantDiLoCo": "fault_tolerant_diloco",
    "Horovod": "horovod",
    "HorovodAdasum": "horovod_adasum",
    "HorovodElastic": "horovod_elastic",
    "Sharded": "sharded",
    "ShardedDiLoCo": "sharded_diloco",
}
"""Each class and the module of this package that defines it."""

__all__ = [*_CLASSES]
STRATEGIES = tuple(name for name in _CLASSES if name != "ElasticMixin")
"""The strategy classes (``lightning_dist.<name>``); ``ElasticMixin`` is for subclassing only."""


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
