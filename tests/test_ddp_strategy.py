"""DDP strategy at 2 CPU processes: parity with Lightning's "ddp", hook really called, no_sync
accumulation, launch modes (argument errors: tests/test_strategy_options.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import shared_runs
from helpers import SCRIPTS, assert_same_weights, load_rank, run_in_sequence

sys.path.insert(0, str(SCRIPTS))

from lightning_dist.workload import TinyCausalLM, WorkloadConfig

pytestmark = pytest.mark.slow
SCRIPT = str(SCRIPTS / "ddp_run.py")
BUDGET = 120
"""Seconds for one 2-process launch (about 6 s for one run on 2 shared cores): at most half the
300 s test timeout, so a stuck launch is stopped by its budget, with its output. The runs Lightning's
own launcher starts are in tests/shared_runs.py (``shared_popen``)."""


@pytest.mark.parametrize("accumulate", [1, 2])
def test_final_weights_equal_lightning_ddp(shared_popen: dict[str, Path], accumulate: int) -> None:
    ref, ours = shared_popen[f"ddp_ref{accumulate}"], shared_popen[f"ddp_ours{accumulate}"]
    ref_w, ref_info = load_rank(ref, 0)
    for rank in (0, 1):
        w, info = load_rank(ours, rank)
        assert info["world_size"] == 2
        assert_same_weights(w, ref_w, atol=1e-6)
        # DDP() keeps gradients in the communication buckets (gradient_as_bucket_view on): a few
        # shared storages, where Lightning's "ddp" gives every gradient its own
        assert info["grads"] == ref_info["grads"] > 0
        assert info["grad_storages"] < info["grads"] == ref_info["grad_storages"]
    initial = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    assert any((initial[k] - ref_w[k]).abs().max() > 1e-4 for k in ref_w), "training changed the weights"


def test_hook_runs_on_cpu_and_accumulation_syncs_once_per_k(shared_popen: dict[str, Path]) -> None:
    once, twice = shared_popen["ddp_k1"], shared_popen["ddp_k2"]
    _, info1 = load_rank(once, 0)
    _, info2 = load_rank(twice, 0)
    assert info1["global_step"] == info2["global_step"] == 4
    assert info1["hook_calls"] > 0, "the comm hook must run on CPU"
    # 4 optimizer steps either way: accumulation over 2 batches must not add communication
    assert info2["hook_calls"] == info1["hook_calls"]
    assert info1["hook_calls"] % 4 == 0
    # the only extra all-reduces are the 4 extra `self.log("train_loss", sync_dist=True)` scalars
    # (ring model at 2 ranks: a 4-byte fp32 scalar sends 4 bytes)
    assert info2["all_reduce_calls"] - info1["all_reduce_calls"] == 4
    assert info2["all_reduce_bytes_sent"] - info1["all_reduce_bytes_sent"] == 4 * 4


@pytest.fixture(scope="module")
def spawned_and_forked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DDP() launched with start_method "spawn", then "fork", from one parent process."""
    root = tmp_path_factory.mktemp("launched")
    run_in_sequence(
        [[SCRIPT, "--strategy", "DDP", "--start-method", method, "--max-steps", "3", "--out", str(root / method)]
         for method in ("spawn", "fork")],
        timeout=BUDGET,
    )  # fmt: skip
    return root


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_spawn_and_fork_launch_match_popen(
    shared_popen: dict[str, Path], spawned_and_forked: Path, start_method: str
) -> None:
    w_popen, _ = load_rank(shared_popen["DDP_popen_3"], 0)
    w_other, info = load_rank(spawned_and_forked / start_method, 0)
    assert info["world_size"] == 2
    assert_same_weights(w_other, w_popen, atol=0)


def test_torchmetrics_and_sync_dist_logging_are_global(shared_popen: dict[str, Path]) -> None:
    import json

    import torchmetrics

    got = json.loads(shared_popen["ddp_metrics.json"].read_text())
    from metric_run import CLASSES, N, dataset  # type: ignore[import-not-found]

    logits, target = dataset().tensors
    expected = torchmetrics.functional.accuracy(
        logits, target, task="multiclass", num_classes=CLASSES, average="micro"
    )
    assert got["seen_rank0"] == N // 2, "each rank validated its own shard"
    assert got["acc"] == pytest.approx(float(expected), abs=1e-6)
    assert got["rank_plus_one"] == pytest.approx(1.5)
    # reduce_fx="sum" sums over ranks and over the epoch's batches: (1 + 2) x 4 batches per rank
    assert got["rank_sum"] == pytest.approx(3.0 * (N // 2) / 5)


@pytest.mark.timeout(2 * 2 * shared_runs.BUDGET)  # both shared launches may start here
def test_torchrun_launch_matches_popen(
    shared_popen: dict[str, Path], shared_torchrun: dict[str, Path]
) -> None:
    out = shared_torchrun["ld_ddp_3_torchrun"]  # under torchrun --standalone, in its shared launch
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["hook_calls"] > 0
        assert_same_weights(w, load_rank(shared_popen["ld_ddp_3"], 0)[0], atol=0)
