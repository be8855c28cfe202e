"""Lightning strategies. The classes are imported on first use (``from lightning_dist.strategies import
DDP``), so this package, its option and name tables, load without Lightning; their names are in
Lightning's ``StrategyRegistry`` once Lightning is loaded (``names.py``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dist.strategies.compressed import Compressed
    from lightning_dist.strategies.ddp import DDP
    from lightning_dist.strategies.diloco import DiLoCo
    from lightning_dist.strategies.elastic import Elastic, ElasticDiLoCo, ElasticMixin
    from lightning_dist.strategies.fault_tolerant import FaultTolerant
    from lightning_dist.strategies.horovod import Horovod
    from lightning_dist.strategies.horovod_adasum import HorovodAdasum
    from lightning_dist.strategies.horovod_elastic import HorovodElastic
    from lightning_dist.strategies.sharded import Sharded
    from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo

_CLASSES = {
    "DDP": "ddp",
    "Compressed": "compressed",
    "DiLoCo": "diloco",
    "Elastic": "elastic",
    "ElasticDiLoCo": "elastic",
    "ElasticMixin": "elastic",
    "FaultTolerant": "fault_tolerant",
    "Horovod": "horovod",
    "HorovodAdasum": "horovod_adasum",
    "HorovodElastic": "horovod_elastic",
    "Sharded": "sharded",
    "ShardedDiLoCo": "sharded_diloco",
}
"""Each class and the module of this package that defines it."""

__all__ = [
    "DDP",
    "Compressed",
    "DiLoCo",
    "Elastic",
    "ElasticDiLoCo",
    "ElasticMixin",
    "FaultTolerant",
    "Horovod",
    "HorovodAdasum",
    "HorovodElastic",
    "Sharded",
    "ShardedDiLoCo",
]


def __getattr__(name: str) -> Any:
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
