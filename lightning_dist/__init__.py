"""lightning_dist: distributed-training strategies for PyTorch Lightning on one collectives layer.

Importing the package loads neither Lightning nor a strategy: ``lightning_dist.DDP`` (and the other
strategies) and the subpackages (``lightning_dist.collectives`` ...) are imported on first use, so
``import lightning_dist.compression`` works where Lightning is not installed. The ``ld_*`` strategy
names are registered in Lightning's ``StrategyRegistry`` as soon as Lightning is loaded too
(``strategies/names.py``), whichever is imported first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_dist.fork_safety import trace_cuda_init
from lightning_dist.strategies import STRATEGIES
from lightning_dist.strategies.names import register_on_import

if TYPE_CHECKING:
    from lightning_dist import collectives as collectives
    from lightning_dist.strategies.compose import compose as compose
    from lightning_dist.strategies.compressed import Compressed as Compressed
    from lightning_dist.strategies.ddp import DDP as DDP
    from lightning_dist.strategies.diloco import DiLoCo as DiLoCo
    from lightning_dist.strategies.elastic import Elastic as Elastic
    from lightning_dist.strategies.elastic_diloco import ElasticDiLoCo as ElasticDiLoCo
    from lightning_dist.strategies.fault_tolerant import FaultTolerant as FaultTolerant
    from lightning_dist.strategies.fault_tolerant_diloco import FaultTolerantDiLoCo as FaultTolerantDiLoCo
    from lightning_dist.strategies.horovod import Horovod as Horovod
    from lightning_dist.strategies.horovod_adasum import HorovodAdasum as HorovodAdasum
    from lightning_dist.strategies.horovod_elastic import HorovodElastic as HorovodElastic
    from lightning_dist.strategies.sharded import Sharded as Sharded
    from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo as ShardedDiLoCo

__all__ = [*STRATEGIES, "collectives", "compose"]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    """``lightning_dist.DDP`` (any strategy) and ``lightning_dist.<subpackage>``, imported on first use."""
    if name in STRATEGIES:
        return getattr(importlib.import_module("lightning_dist.strategies"), name)
    if name == "compose":
        return importlib.import_module("lightning_dist.strategies.compose").compose
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise  # the module exists; something it imports is missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


register_on_import()  # the ld_* names, in Lightning's StrategyRegistry once Lightning is loaded
trace_cuda_init()  # a fork launch after CUDA's initialisation then names the call that did it
