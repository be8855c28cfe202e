"""Every strategy name the pack registers in Lightning's ``StrategyRegistry``, in one table, and when.

``import lightning_dist`` loads neither Lightning nor a strategy. It asks for the names to be
registered once Lightning's ``lightning.pytorch.strategies`` is loaded: at once when Lightning is
imported already, else right after Lightning is (``lightning_dist.import_hook``), whichever of the
two a user imports first. A name then holds a ``LazyStrategy`` that imports its class when Lightning
first builds it (``Trainer(strategy="ld_ddp")``), and the class itself from the moment its module is
imported. ``Strategy.register_strategies(registry)`` registers a class's names in any registry.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Optional

from lightning_dist.compression import COMPRESSORS
from lightning_dist.import_hook import when_imported
from lightning_dist.strategies.options import (
    DILOCO_COMPRESSIONS,
    DILOCO_LOWBIT_COMPRESSIONS,
    HOROVOD_COMPRESSIONS,
    SHARDED_COMPRESSIONS,
)
from lightning_dist.strategies.registry import LazyStrategy, register

__all__ = ["NAMES", "Name", "register_class", "register_names", "register_on_import"]

LIGHTNING_STRATEGIES = "lightning.pytorch.strategies"
_PACKAGE = "lightning_dist.strategies"
DDP = f"{_PACKAGE}.ddp.DDP"
COMPRESSED = f"{_PACKAGE}.compressed.Compressed"
DILOCO = f"{_PACKAGE}.diloco.DiLoCo"
ELASTIC = f"{_PACKAGE}.elastic.Elastic"
ELASTIC_DILOCO = f"{_PACKAGE}.elastic_diloco.ElasticDiLoCo"
HOROVOD = f"{_PACKAGE}.horovod.Horovod"
HOROVOD_ADASUM = f"{_PACKAGE}.horovod_adasum.HorovodAdasum"
HOROVOD_ELASTIC = f"{_PACKAGE}.horovod_elastic.HorovodElastic"
SHARDED = f"{_PACKAGE}.sharded.Sharded"
SHARDED_DILOCO = f"{_PACKAGE}.sharded_diloco.ShardedDiLoCo"
FAULT_TOLERANT = f"{_PACKAGE}.fault_tolerant.FaultTolerant"
FAULT_TOLERANT_COMPRESSORS = ("fp16", "bf16", "int8", "powersgd")
"""The compressors with a registered ``ld_fault_tolerant_<compressor>`` name."""
FAULT_TOLERANT_DILOCO = f"{_PACKAGE}.fault_tolerant_diloco.FaultTolerantDiLoCo"


@dataclass(frozen=True)
class Name:
    """One registered name."""

    name: str
    """``ld_...`` (``Trainer(strategy=name)``)."""
    strategy: str
    """The class it builds, as ``module.Class``."""
    description: str
    deprecated: str = ""
    """The bare name of the first release that still builds it, with a FutureWarning ("" for none)."""
    init_params: Mapping[str, Any] = field(default_factory=dict)
    """The options the name passes to the class."""


def _names() -> list[Name]:
    names = [
        Name(name, DDP, f"DDP over torch's reducer, launched with start_method={start!r}", "", {"start_method": start})
        for name, start in (
            ("ld_ddp", "auto"),
            ("ld_ddp_popen", "popen"),
            ("ld_ddp_spawn", "spawn"),
            ("ld_ddp_fork", "fork"),
            ("ld_ddp_notebook", "fork"),
        )
    ]  # fmt: skip
    names.append(
        Name(
            "ld_ddp_adasum",
            DDP,
            "DDP with gradient-space Adasum instead of the average (any backend, no Horovod)",
            init_params={"reduce_op": "adasum"},
        )
    )
    for compressor in COMPRESSORS:
        description = (
            f"DDP with {compressor} gradient compression"
            if compressor != "none"
            else "Compressed's path, no compression"
        )
        if COMPRESSORS[compressor].warmup_fraction:
            share = f"{COMPRESSORS[compressor].warmup_fraction:.0%}"
            description += f", after an uncompressed warm-up ({share} of the steps: warmup='auto')"
        names.append(
            Name(
                f"ld_compressed_{compressor}",
                COMPRESSED,
                description,
                f"compressed_{compressor}",
                {"compressor": compressor},
            )
        )
    names.append(
        Name(
            "ld_diloco",
            DILOCO,
            "DiLoCo: local steps, then an outer Nesterov step on the averaged change",
            "diloco",
        )
    )
    for wire in DILOCO_COMPRESSIONS[1:]:
        description = f"DiLoCo with {wire} pseudo-gradients on the wire"
        names.append(Name(f"ld_diloco_{wire}", DILOCO, description, f"diloco_{wire}", {"compression": wire}))
    for wire in DILOCO_LOWBIT_COMPRESSIONS:  # newer than the bare names: no deprecated alias
        description = f"DiLoCo with {wire} pseudo-gradients on the wire"
        names.append(Name(f"ld_diloco_{wire}", DILOCO, description, init_params={"compression": wire}))
    names += [
        Name(
            "ld_elastic",
            ELASTIC,
            "elastic DDP under torchrun: atomic commits, exactly-once data across restarts",
            "elastic",
        ),
        Name(
            "ld_elastic_diloco",
            ELASTIC_DILOCO,
            "DiLoCo with Elastic's commits and exactly-once data (torchrun)",
            "elastic_diloco",
        ),
        Name(
            "ld_fault_tolerant",
            FAULT_TOLERANT,
            "live recovery on torchft: healthy replica groups train on, a failed one rejoins from a peer",
        ),
        Name("ld_horovod", HOROVOD, "Horovod, average of the gradients", "horovod"),
        Name("ld_horovod_sum", HOROVOD, "Horovod, sum of the gradients", "horovod_sum", {"op": "sum"}),
    ]
    for wire in (c for c in HOROVOD_COMPRESSIONS if c not in (None, "none")):
        description = f"Horovod, {wire} gradients on the wire"
        names.append(
            Name(f"ld_horovod_{wire}", HOROVOD, description, f"horovod_{wire}", {"compression": wire})
        )
    names.append(
        Name(
            "ld_horovod_adasum",
            HOROVOD_ADASUM,
            "Horovod with Adasum of the optimizer updates (MPI controller)",
            "horovod_adasum",
        )
    )
    names.append(
        Name(
            "ld_horovod_elastic",
            HOROVOD_ELASTIC,
            "Horovod under horovodrun's elastic engine (Gloo): commits and exactly-once data across resets",
        )
    )
    names.append(
        Name("ld_sharded", SHARDED, "FSDP2 sharding over every rank, the pack's reduce-scatter (fp32)")
    )
    for wire in SHARDED_COMPRESSIONS[1:]:
        description = f"FSDP2 sharding, gradients reduce-scattered in {wire}"
        names.append(Name(f"ld_sharded_{wire}", SHARDED, description, init_params={"compression": wire}))
    names.append(
        Name(
            "ld_sharded_diloco",
            SHARDED_DILOCO,
            "DiLoCo over FSDP2 shards: replica groups exchange their shards' pseudo-gradients",
        )
    )
    for wire in DILOCO_COMPRESSIONS[1:] + DILOCO_LOWBIT_COMPRESSIONS:
        description = f"DiLoCo over FSDP2 shards with {wire} pseudo-gradients on the wire"
        names.append(
            Name(f"ld_sharded_diloco_{wire}", SHARDED_DILOCO, description, init_params={"compression": wire})
        )
    for compressor in FAULT_TOLERANT_COMPRESSORS:
        description = f"live recovery on torchft, {compressor} gradient compression"
        names.append(
            Name(
                f"ld_fault_tolerant_{compressor}",
                FAULT_TOLERANT,
                description,
                init_params={"compressor": compressor},
            )
        )
    names.append(
        Name(
            "ld_fault_tolerant_diloco",
            FAULT_TOLERANT_DILOCO,
            "DiLoCo on torchft: a replica group that fails rejoins from the last sync and redoes its share",
        )
    )
    names.append(
        Name(
            "ld_fault_tolerant_diloco_int8",
            FAULT_TOLERANT_DILOCO,
            "DiLoCo on torchft with int8 pseudo-gradients on the wire",
            init_params={"compression": "int8"},
        )
    )
    return names


NAMES: list[Name] = _names()
"""Every name, in the order they are registered."""


def _register(registry: Any, entry: Name, target: Any) -> None:
    register(registry, entry.name, target, entry.description, entry.deprecated, **entry.init_params)


def register_class(registry: Any, cls: type) -> None:
    """Register the names that build ``cls`` (what ``Strategy.register_strategies`` does)."""
    path = f"{cls.__module__}.{cls.__qualname__}"
    for entry in NAMES:
        if entry.strategy == path:
            _register(registry, entry, cls)


def _imported(path: str) -> Optional[type]:
    """The class ``module.Class`` when its module is imported (and defines it), else None."""
    module, _, name = path.rpartition(".")
    cls: Optional[type] = getattr(sys.modules.get(module), name, None)
    return cls


def register_names(registry: Any) -> None:
    """Register every name in ``registry``: the class where its module is imported, else a
    ``LazyStrategy`` that imports it on first use."""
    for entry in NAMES:
        _register(registry, entry, _imported(entry.strategy) or LazyStrategy(entry.strategy))


def _lightning_loaded(strategies: ModuleType) -> None:
    register_names(strategies.StrategyRegistry)
    # compat checks the Lightning version (an untested one warns once) when it loads; it may be the
    # module importing Lightning right now, so import it only when it is not loading already
    if "lightning_dist.compat" not in sys.modules:
        import lightning_dist.compat  # noqa: F401


def _strategy_module_loaded(module: ModuleType) -> None:
    """The classes of ``module`` replace their ``LazyStrategy`` entries (a name another package holds
    stays its own)."""
    strategies = sys.modules.get(LIGHTNING_STRATEGIES)
    if strategies is None:
        return
    registry = strategies.StrategyRegistry
    for entry in NAMES:
        target = registry[entry.name]["strategy"] if entry.name in registry else None
        if isinstance(target, LazyStrategy) and target.path.rpartition(".")[0] == module.__name__:
            registry[entry.name]["strategy"] = getattr(module, target.path.rpartition(".")[2])


def register_on_import() -> None:
    """What ``import lightning_dist`` does: the names go into Lightning's registry once Lightning's
    strategies module is loaded, and each class takes its names' place once its module is."""
    when_imported(LIGHTNING_STRATEGIES, _lightning_loaded)
    for module in sorted({entry.strategy.rpartition(".")[0] for entry in NAMES}):
        when_imported(module, _strategy_module_loaded)
