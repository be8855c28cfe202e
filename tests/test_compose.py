"""``compose``: a strategy named by its parts. Every working combination builds the preset that
implements it, configured as that preset built by hand (so the presets' trained-parity tests are
the combination's); every other one is refused at construction with its reason; docs/strategies.md
shows the same table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import lightning_dist as ld
from lightning_dist.strategies.compose import COMBINATIONS, Combination, compose

ROOT = Path(__file__).resolve().parents[1]
LIGHTHOUSE = {"lighthouse": "http://localhost:29510"}

BY_HAND: list[tuple[dict[str, Any], Any]] = [
    ({}, lambda: ld.DDP()),
    ({"wire": "int8"}, lambda: ld.Compressed("int8")),
    ({"sync": "adasum"}, lambda: ld.DDP(reduce_op="adasum")),
    ({"sync": "adasum", "wire": "bf16"}, lambda: ld.Compressed("bf16", reduce_op="adasum")),
    (
        {"sync": "diloco", "wire": "int8", "inner_steps": 8},
        lambda: ld.DiLoCo(inner_steps=8, compression="int8"),
    ),
    ({"layout": "sharded", "wire": "int8"}, lambda: ld.Sharded("int8")),
    ({"layout": "hybrid", "wire": "powersgd"}, lambda: ld.Sharded(replicas=2, replica_sync="powersgd")),
    (
        {"layout": "hybrid", "sync": "adasum", "replicas": 4},
        lambda: ld.Sharded(replicas=4, replica_sync="none", reduce_op="adasum"),
    ),
    (
        {"layout": "hybrid", "sync": "diloco", "wire": "int8", "inner_steps": 32},
        lambda: ld.ShardedDiLoCo(inner_steps=32, compression="int8"),
    ),
    ({"resilience": "commits", "commit_every": 5}, lambda: ld.Elastic(commit_every=5)),
    ({"resilience": "commits", "sync": "adasum"}, lambda: ld.Elastic(reduce_op="adasum")),
    ({"resilience": "commits", "sync": "diloco", "inner_steps": 4}, lambda: ld.ElasticDiLoCo(inner_steps=4)),
    (
        {"resilience": "live", "wire": "int8", **LIGHTHOUSE},
        lambda: ld.FaultTolerant(compressor="int8", **LIGHTHOUSE),
    ),
    (
        {"resilience": "live", "sync": "adasum", **LIGHTHOUSE},
        lambda: ld.FaultTolerant(reduce_op="adasum", **LIGHTHOUSE),
    ),
    (
        {"resilience": "live", "sync": "diloco", "inner_steps": 4, **LIGHTHOUSE},
        lambda: ld.FaultTolerantDiLoCo(inner_steps=4, **LIGHTHOUSE),
    ),
    ({"engine": "horovod", "wire": "fp16"}, lambda: ld.Horovod(compression="fp16")),
    ({"engine": "horovod", "sync": "adasum"}, lambda: ld.HorovodAdasum()),
    ({"engine": "horovod", "resilience": "commits"}, lambda: ld.HorovodElastic()),
]


def configuration(strategy: Any) -> dict[str, Any]:
    """What a strategy was built with: its class and its option groups / plain settings."""
    plain = (str, int, float, bool, type(None))
    settings = {
        k: repr(v)
        for k, v in vars(strategy).items()
        if isinstance(v, plain)
        or type(v).__name__.endswith(("Options", "Compression", "Quantization", "PowerSGD"))
    }
    return {"class": type(strategy).__name__, **settings}


@pytest.mark.parametrize(("parts", "by_hand"), BY_HAND, ids=[str(p) for p, _ in BY_HAND])
def test_a_combination_builds_its_preset_as_built_by_hand(parts: dict[str, Any], by_hand: Any) -> None:
    assert configuration(compose(**parts)) == configuration(by_hand())


def test_every_working_combination_is_covered_by_hand() -> None:
    covered = set()
    for parts, _ in BY_HAND:
        p = {"layout": "replicated", "sync": "mean", "resilience": None, "engine": "torch", **parts}
        covered.add((p["layout"], p["sync"], p["resilience"], p["engine"]))
    working = {(c.layout, c.sync, c.resilience, c.engine) for c in COMBINATIONS if c.preset}
    assert working == covered


@pytest.mark.parametrize("row", [c for c in COMBINATIONS if c.preset is None], ids=Combination.words)
def test_every_other_combination_is_refused_with_its_reason(row: Combination) -> None:
    assert (
        row.refusal and row.refusal.startswith(("is not supported", "is not built")) and "use " in row.refusal
    )
    with pytest.raises(ValueError, match=re.escape(f"compose: {row.words()} {row.refusal}")):
        compose(row.layout, row.sync, None, row.resilience, row.engine, **LIGHTHOUSE)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layout": "zero3"}, "layout='zero3' is not supported; accepted: 'replicated', 'sharded', 'hybrid'"),
        ({"sync": "local_sgd"}, "sync='local_sgd' is not supported; accepted: 'mean', 'adasum', 'diloco'"),
        (
            {"resilience": "restarts"},
            "resilience='restarts' is not supported; accepted: None, 'commits', 'live'",
        ),
        ({"engine": "mpi"}, "engine='mpi' is not supported; accepted: 'torch', 'horovod'"),
        ({"layout": "hybrid", "replicas": 1}, "replicas=1: layout='hybrid' needs replicas >= 2"),
        ({"sync": "diloco", "wire": "topk"}, "compression='topk' is not supported by DiLoCo"),
        ({"inner_steps": 4}, "unknown option"),
        (
            {"resilience": "live", "sync": "adasum", "wire": "powersgd", **LIGHTHOUSE},
            "FaultTolerant: compressor='powersgd' with reduce_op='adasum'",
        ),
    ],
)
def test_bad_parts_name_the_argument_and_what_is_accepted(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        compose(**kwargs)


def test_the_docs_show_the_table() -> None:
    """docs/strategies.md lists every combination of engine='torch' with its preset or its reason."""
    text = (ROOT / "docs" / "strategies.md").read_text()
    for row in COMBINATIONS:
        if row.engine != "torch":
            continue
        resilience = "-" if row.resilience is None else row.resilience
        cell = f"`{row.preset}`" if row.preset else "refused"
        assert re.search(rf"\| {row.layout} \| {row.sync} \| {resilience} \| {cell} \|", text), row.words()
