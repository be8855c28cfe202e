"""ShardedDiLoCo: argument checks and names (fast), then one 4-process launch (2 replica groups x 2
shards, CPU, Gloo) against references: Sharded() HSDP (H=1, outer SGD lr 1, no momentum, inner SGD),
an uninterrupted run (resume mid-period), the uncompressed run (int8 pseudo-gradients, a bound from
the quantisation step), a resume at another shard count (the last-sync weights, a warning), and a fit
ending inside a period (every replica group on the same synced weights, the checkpoint's)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, max_abs_diff, run_script
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist import ShardedDiLoCo
from lightning_dist.compression import Int8Quantization, ring_all_reduce_bytes

SCRIPT = str(SCRIPTS / "sharded_diloco_run.py")
RANKS = range(4)


# -- fast: arguments and names ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inner_steps": 0}, "inner_steps=0 must be an integer >= 1"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0 must be in \[0, 1\)"),
        ({"compression": "powersgd"}, "compression='powersgd' is not supported by DiLoCo"),
        ({"replicas": 0}, "replicas=0 is not supported; accepted: 'auto' or an integer >= 1"),
        ({"replicas": "two"}, "replicas='two' is not supported"),
        ({"shard_compression": "topk"}, "compression='topk'"),
        ({"replica_sync": "int8"}, "ShardedDiLoCo got unknown option.*replica_sync.*accepted: inner_steps"),
    ],
)
def test_bad_arguments_fail_early_naming_them(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardedDiLoCo(**kwargs)


def test_accepted_arguments_and_registered_names() -> None:
    s = ShardedDiLoCo(inner_steps=32, compression="int8", replicas=2, shard_compression="int8")
    assert (s.inner_steps, s.compressor.name, s.options.replicas, s.options.compression) == (
        32,
        "int8",
        2,
        "int8",
    )
    assert s.replica_hook(None, 0) is None, "no gradient sync across replica groups"  # type: ignore[arg-type]
    assert StrategyRegistry["ld_sharded_diloco"]["strategy"] is ShardedDiLoCo
    for wire in ("fp16", "bf16", "int8"):
        assert StrategyRegistry[f"ld_sharded_diloco_{wire}"]["init_params"] == {"compression": wire}


# -- 4 processes over Gloo ----------------------------------------------------------------------------
HSDP = {"replicas": 2}
H4 = {"inner_steps": 4, **HSDP}
RESUME = {"model": "mlp", "optimizer": "adamw", "lr": 0.01, "batches_per_epoch": 6, "options": H4}
"""6 optimizer steps per epoch with H=4: the end of epoch 1 is inner step 2 of the second period."""
FIXTURE_BUDGET = 240
"""Seconds for the launch (about 60 s on 2 shared cores), at most half the timeout of each test."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded_diloco")
    ckpt = str(out / "epoch1.ckpt")
    plain = {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, **HSDP}
    one_sync = {"model": "mlp", "optimizer": "adamw", "lr": 0.01, "steps": 4}
    configs: list[dict[str, Any]] = [
        {"name": "sharded_sgd", "strategy": "sharded", "model": "mlp", "options": HSDP},
        {"name": "h1_sgd", "model": "mlp", "options": plain},
        # the checkpoint of the end of epoch 1, mid-period, written inside the 2-epoch fit ("first")
        {"name": "full", "epochs": 2, "save": ckpt, "save_at_epoch": 0, "snapshot_as": "first", **RESUME},
        {"name": "tail", "epochs": 1, "checkpoint": {"save_top_k": 0}, **RESUME},
        {"name": "resumed", "epochs": 2, "resume": ckpt, **RESUME},
        {"name": "reshard", "epochs": 2, "resume": ckpt, **RESUME, "options": {**H4, "replicas": 4}},
        {"name": "none_one_sync", **one_sync, "options": H4},
        {"name": "int8_one_sync", **one_sync, "options": {**H4, "compression": "int8"}},
    ]
    run_script(
        [SCRIPT, "--out", str(out), "--devices", "4", "--runs", json.dumps(configs)], timeout=FIXTURE_BUDGET
    )
    return out


def weights(out: Path, name: str, rank: int = 0, key: str = "weights") -> dict[str, torch.Tensor]:
    return dict(torch.load(out / f"{name}.rank{rank}.pt")[key])


def info(out: Path, name: str, rank: int = 0) -> dict[str, Any]:
    return dict(json.loads((out / f"{name}.rank{rank}.json").read_text()))


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_h1_plain_average_is_sharded_hsdp(runs: Path) -> None:
    """H=1, outer lr 1, no momentum, inner SGD: each replica group's step is -lr g_r, the outer step
    subtracts the average of (p - (p - lr g_r)): Sharded(replicas=2)'s p - lr avg(g_r), up to the
    rounding of that subtraction (a few float32 ulps of the weights per step), hence atol 1e-6."""
    for rank in RANKS:
        ref, got = weights(runs, "sharded_sgd", rank), weights(runs, "h1_sgd", rank)
        print(f"h1 rank {rank} vs Sharded(): max abs diff {max_abs_diff(got, ref):.3g}")
        assert_same_weights(got, ref, atol=1e-6)
    assert info(runs, "h1_sgd")["syncs"] == 6
    moved = max_abs_diff(weights(runs, "sharded_sgd"), weights(runs, "sharded_sgd", 0, "initial"))
    assert moved > 1e-3, "the comparison is of trained weights"


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_resume_mid_period_is_bitwise_uninterrupted(runs: Path) -> None:
    first = info(runs, "first")
    assert (first["global_step"], first["syncs"], first["inner_step"]) == (6, 1, 2)
    assert max_abs_diff(weights(runs, "first", 0), weights(runs, "first", 2)) > 0, (
        "mid-period the replica groups' weights differ"
    )
    for rank in RANKS:
        got, full = info(runs, "resumed", rank), info(runs, "full", rank)
        assert got["global_step"] == full["global_step"] == 12 and got["syncs"] == full["syncs"] == 3
        assert got["warnings"] == []
        assert_same_weights(weights(runs, "resumed", rank), weights(runs, "full", rank), atol=0)


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_resume_at_another_shard_count_starts_from_the_last_sync(runs: Path) -> None:
    """Saved at 2 replica groups x 2 shards mid-period, resumed at 4 x 1: the weights resharded from
    the checkpoint's model entry, the last-sync ones, and a warning naming what is dropped."""
    warned = info(runs, "reshard")["warnings"]
    assert any(
        "replicas=2" in w and "outer momentum" in w and "inner optimizer state" in w for w in warned
    ), warned
    got = info(runs, "reshard")
    # resumed at step 6 with inner step 0: syncs at 10 (the saved count, 1, plus one) and at 12 (the tail)
    assert (got["global_step"], got["syncs"], got["inner_step"]) == (12, 3, 0) and math.isfinite(
        got["train_loss"]
    )
    last_sync = weights(runs, "first", 0, "anchors")
    assert_same_weights(last_sync, weights(runs, "first", 2, "anchors"), atol=0)
    assert max_abs_diff(last_sync, weights(runs, "first", 0)) > 0, (
        "the current weights are not the last-sync ones"
    )
    for rank in RANKS:
        assert max_abs_diff(weights(runs, "reshard", rank), last_sync) > 0, "it trained on"


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_int8_pseudo_gradients_within_the_quantisation_bound(runs: Path) -> None:
    """One sync (H=4) with int8 pseudo-gradients against the uncompressed one: the inner steps are the
    same, so the weights differ only by the outer step of the quantisation error. Each replica group's
    shard pseudo-gradient d_r is rounded to the nearest of 255 levels per block of its absmax, an error
    <= absmax/254; their average errs by at most max_r |d_r|_inf / 254; the first Nesterov step moves by
    lr (1 + momentum) times it (0.7 x 1.9)."""
    none, int8 = info(runs, "none_one_sync"), info(runs, "int8_one_sync")
    assert none["syncs"] == int8["syncs"] == 1
    absmax = max(info(runs, "int8_one_sync", r)["delta_absmax"][0] for r in RANKS)
    bound = 0.7 * 1.9 * absmax / 254 + 1e-6  # + float32 rounding of the weights
    for rank in RANKS:
        drift = max_abs_diff(weights(runs, "int8_one_sync", rank), weights(runs, "none_one_sync", rank))
        print(f"int8 rank {rank}: max abs diff {drift:.3g}, bound {bound:.3g}")
        assert 0 < drift <= bound
    # bytes: one ring all-reduce of this rank's fp32 shard, against int8's one all-gather at 2 replicas
    for rank in RANKS:
        n = info(runs, "none_one_sync", rank)["local_numel"]
        assert info(runs, "none_one_sync", rank)["sync_bytes"] == ring_all_reduce_bytes(4 * n, 2)
        assert info(runs, "int8_one_sync", rank)["sync_bytes"] == Int8Quantization().wire_bytes([(n,)], 2)
    # this MLP's 802-element shard pads to one 1024-element int8 block: 1032 bytes against 3208
    assert info(runs, "int8_one_sync")["sync_bytes"] < 0.33 * info(runs, "none_one_sync")["sync_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_a_fit_ending_inside_a_period_ends_every_replica_group_on_the_saved_weights(
    runs: Path, tmp_path: Path
) -> None:
    """One epoch of 6 steps with H=4: the 2 steps after the sync at 4 are synced at the end of fit, so
    both replica groups (all 4 ranks) end on the same weights, bitwise, which are the last-sync ones;
    the last.ckpt ModelCheckpoint wrote at on_train_end holds them (its model entry: the last-sync
    weights)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    first = weights(runs, "tail", 0)
    assert max_abs_diff(first, weights(runs, "tail", 0, "initial")) > 1e-3, "it trained"
    for rank in RANKS:
        got = info(runs, "tail", rank)
        assert (got["global_step"], got["syncs"], got["inner_step"]) == (6, 2, 0)
        assert_same_weights(weights(runs, "tail", rank), first, atol=0)
        assert_same_weights(weights(runs, "tail", rank, "anchors"), first, atol=0)
    assert sorted(p.name for p in (runs / "tail").iterdir()) == ["last.ckpt"]
    dcp_to_torch_save(runs / "tail" / "last.ckpt", tmp_path / "last.pt")
    saved = torch.load(tmp_path / "last.pt", weights_only=False)
    model = saved.get("state_dict", saved)
    assert_same_weights({k: model[k] for k in first}, first, atol=0)
