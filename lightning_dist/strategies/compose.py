"""A strategy named by its parts: ``compose(layout=..., sync=..., wire=..., resilience=..., engine=...)``.

    Trainer(strategy=compose(layout="hybrid", replicas=2, wire="int8"))      # Sharded(replicas=2, replica_sync="int8")
    Trainer(strategy=compose(sync="diloco", resilience="commits", inner_steps=100))   # ElasticDiLoCo

The parts (DESIGN.md): *layout* replicated (torch's DDP reducer), sharded (FSDP2) or hybrid (replicas
x shards); *sync* every step by ``"mean"`` or ``"adasum"``, or DiLoCo's inner/outer loop; *wire* any
compressor on the collective the layout and sync use (None: uncompressed); *resilience* None, commits
with torchrun restarts, or live recovery on torchft; *engine* torch.distributed or Horovod. Each
combination either builds the preset that implements it, with the parts' options and any other
keyword of that preset, or is refused here, before any process starts, with a ``ValueError`` saying
why. ``COMBINATIONS`` is the whole table (docs/strategies.md shows it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from itertools import product
from typing import Any, Optional

from lightning_dist.checks import check_choice

__all__ = ["COMBINATIONS", "Combination", "compose"]

LAYOUTS = ("replicated", "sharded", "hybrid")
SYNCS = ("mean", "adasum", "diloco")
RESILIENCES = (None, "commits", "live")
ENGINES = ("torch", "horovod")

_RESHARD = (
    "is not built: a resize must reshard FSDP2's parameters and optimizer state through torch's "
    "distributed checkpoint; use layout='replicated' for commits, or a sharded layout without resilience"
)
_LIVE_SHARDS = (
    "is not built: live recovery sends a replica group's whole state from a healthy peer, and FSDP2's "
    "shards would need it per shard group; use layout='replicated' for live recovery"
)
_REFUSALS: dict[tuple[Optional[str], ...], str] = {
    (None, None, None, "horovod"): "is not supported: Horovod is its own transport and runs layout="
    "'replicated' with sync='mean' or 'adasum', or 'mean' with resilience='commits'; use engine='torch'",
    ("sharded", "adasum", None, None): "is not supported: inside a shard group FSDP2's reduce-scatter sums; "
    "Adasum combines replica groups, use layout='hybrid'",
    ("sharded", "diloco", None, None): "is not supported: DiLoCo averages over replica groups and one "
    "sharded group has none; use layout='hybrid'",
    ("sharded", None, "commits", None): _RESHARD,
    ("hybrid", None, "commits", None): _RESHARD,
    ("sharded", None, "live", None): _LIVE_SHARDS,
    ("hybrid", None, "live", None): _LIVE_SHARDS,
}
"""Refused combinations: (layout, sync, resilience, engine), None matching any, and why; the first
match counts."""

_PRESETS: dict[tuple[str, str, Optional[str], str], str] = {
    ("replicated", "mean", None, "torch"): "DDP",
    ("replicated", "adasum", None, "torch"): "DDP",
    ("replicated", "diloco", None, "torch"): "DiLoCo",
    ("sharded", "mean", None, "torch"): "Sharded",
    ("hybrid", "mean", None, "torch"): "Sharded",
    ("hybrid", "adasum", None, "torch"): "Sharded",
    ("hybrid", "diloco", None, "torch"): "ShardedDiLoCo",
    ("replicated", "mean", "commits", "torch"): "Elastic",
    ("replicated", "adasum", "commits", "torch"): "Elastic",
    ("replicated", "diloco", "commits", "torch"): "ElasticDiLoCo",
    ("replicated", "mean", "live", "torch"): "FaultTolerant",
    ("replicated", "adasum", "live", "torch"): "FaultTolerant",
    ("replicated", "diloco", "live", "torch"): "FaultTolerantDiLoCo",
    ("replicated", "mean", None, "horovod"): "Horovod",
    ("replicated", "adasum", None, "horovod"): "HorovodAdasum",
    ("replicated", "mean", "commits", "horovod"): "HorovodElastic",
}
"""The preset that implements each working combination (a compressor as wire turns DDP into Compressed)."""


@dataclass(frozen=True)
class Combination:
    """One row of the table: the parts, and the preset that implements them or why they are refused."""

    layout: str
    sync: str
    resilience: Optional[str]
    engine: str
    preset: Optional[str]
    refusal: Optional[str]

    def words(self) -> str:
        return (
            f"layout={self.layout!r}, sync={self.sync!r}, resilience={self.resilience!r}, "
            f"engine={self.engine!r}"
        )


def _refusal(parts: tuple[str, str, Optional[str], str]) -> Optional[str]:
    for pattern, why in _REFUSALS.items():
        if all(p is None or p == v for p, v in zip(pattern, parts, strict=True)):
            return why
    return None


def _combination(layout: str, sync: str, resilience: Optional[str], engine: str) -> Combination:
    parts = (layout, sync, resilience, engine)
    preset = _PRESETS.get(parts)
    refusal = None if preset is not None else _refusal(parts) or "is not built"
    return Combination(layout, sync, resilience, engine, preset, refusal)


COMBINATIONS = [_combination(*parts) for parts in product(LAYOUTS, SYNCS, RESILIENCES, ENGINES)]


def _uncompressed(wire: Any) -> bool:
    return wire is None or (isinstance(wire, str) and wire.lower() == "none")


def _arguments(row: Combination, wire: Any, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The preset class name and its keyword arguments for ``row`` with ``wire`` and ``options``."""
    preset, adasum = row.preset, row.sync == "adasum"
    assert preset is not None
    if preset == "DDP":
        if _uncompressed(wire):
            return "DDP", {**options, **({"reduce_op": "adasum"} if adasum else {})}
        return "Compressed", {"compressor": wire, **options, "reduce_op": "adasum" if adasum else "avg"}
    if preset == "Sharded":
        if row.layout == "sharded":
            return preset, {"compression": None if _uncompressed(wire) else wire, **options}
        if options.get("replicas", 2) < 2:
            raise ValueError(f"replicas={options['replicas']!r}: layout='hybrid' needs replicas >= 2")
        sync = {"replica_sync": "none" if wire is None else wire, "reduce_op": "adasum" if adasum else "avg"}
        return preset, {"replicas": 2, **options, **sync}
    if preset in ("Elastic", "HorovodElastic", "Horovod", "HorovodAdasum"):
        extra = {"reduce_op": "adasum"} if adasum and preset == "Elastic" else {}
        return preset, {**options, "compression": wire, **extra}
    if preset == "FaultTolerant":
        extra = {"reduce_op": "adasum"} if adasum else {}
        return preset, {**options, **({} if wire is None else {"compressor": wire}), **extra}
    return preset, {**options, "compression": wire}  # the DiLoCo family


def compose(
    layout: str = "replicated",
    sync: str = "mean",
    wire: Any = None,
    resilience: Optional[str] = None,
    engine: str = "torch",
    **options: Any,
) -> Any:
    """The strategy of these parts (see the module docstring); ``options`` go to its preset
    (``inner_steps=100``, ``replicas=2``, ``commit_every=50`` ...), which checks them."""
    check_choice("layout", layout, LAYOUTS, owner="compose")
    check_choice("sync", sync, SYNCS, owner="compose")
    check_choice("resilience", resilience, RESILIENCES, owner="compose")
    check_choice("engine", engine, ENGINES, owner="compose")
    row = _combination(layout, sync, resilience, engine)
    if row.preset is None:
        raise ValueError(f"compose: {row.words()} {row.refusal}")
    name, kwargs = _arguments(row, wire, dict(options))
    return getattr(importlib.import_module("lightning_dist.strategies"), name)(**kwargs)
