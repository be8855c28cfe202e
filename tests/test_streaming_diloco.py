"""Streaming DiLoCo (``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha`` on DiLoCo and
ShardedDiLoCo): option checks and the fragment split (fast), then one 2-process launch of DiLoCo
against references: P=1, tau=0, alpha=0 bitwise the whole-model sync of before (written out in the
script) and the options omitted; P=2, tau=1, alpha=0.5 against a single-process float64 reference;
per-step bytes at most 1/P of DiLoCo's (the largest fragment's share); a resume mid-period with an
exchange in flight bitwise uninterrupted; every rank on the same weights at the end of fit (the
tail, also with an exchange in flight at a callback's stop); and one 2-process launch of
ShardedDiLoCo (2 replica groups) resuming bitwise; and ElasticDiLoCo under torchrun, a worker
SIGKILLed after a commit taken with an exchange in flight, ending on the fault-free run's weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import references
import torch
from helpers import SCRIPTS, assert_same_weights, max_abs_diff, run_script
from test_elastic import STEPS, torchrun_proc

from lightning_dist import DiLoCo, ShardedDiLoCo
from lightning_dist.algorithms.diloco_fragments import split_fragments
from lightning_dist.strategies.fault_tolerant_diloco import FaultTolerantDiLoCo
from lightning_dist.workload import TinyCausalLM, WorkloadConfig

SCRIPT = str(SCRIPTS / "diloco_run.py")
SHARDED_SCRIPT = str(SCRIPTS / "sharded_diloco_run.py")
LR, WEIGHT_DECAY = 3e-3, 0.01  # the script's AdamW


# -- fast: options and the split -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fragments": 0}, r"fragments=0 must be an integer in \[1, 4\]"),
        ({"fragments": 8}, r"fragments=8 must be an integer in \[1, 4\]"),
        ({"fragments": 3}, "fragments=3 must divide inner_steps=4"),
        ({"fragments": 2.0}, "fragments=2.0 must be an integer"),
        ({"fragments": 2, "fragment_sync_delay": 2}, r"fragment_sync_delay=2 must be an integer in \[0, 1\]"),
        ({"fragment_sync_delay": -1}, r"fragment_sync_delay=-1 must be an integer >= 0"),
        ({"fragment_sync_delay": True}, "fragment_sync_delay=True must be an integer"),
        ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha=1.5 must be in \[0, 1\]"),
        ({"fragment_update_alpha": -0.1}, r"fragment_update_alpha=-0.1 must be in \[0, 1\]"),
        ({"fragment_update_alpha": float("nan")}, r"fragment_update_alpha=nan must be in \[0, 1\]"),
    ],
)
def test_bad_options_fail_early_naming_them(kwargs: dict[str, Any], message: str) -> None:
    for cls in (DiLoCo, ShardedDiLoCo):
        with pytest.raises(ValueError, match=message):
            cls(inner_steps=4, **kwargs)


def test_fault_tolerant_diloco_refuses_streaming_naming_why() -> None:
    for kwargs in ({"fragments": 2}, {"fragment_sync_delay": 1}, {"fragment_update_alpha": 0.5}):
        with pytest.raises(ValueError, match="FaultTolerantDiLoCo: fragment.* is not supported: its periods"):
            FaultTolerantDiLoCo(inner_steps=4, **kwargs)
    FaultTolerantDiLoCo(inner_steps=4, fragments=1, fragment_sync_delay=0, fragment_update_alpha=0.0)


def test_accepted_options_are_held_by_the_sync_part() -> None:
    s = DiLoCo(inner_steps=8, fragments=4, fragment_sync_delay=1, fragment_update_alpha=0.25)
    assert (s.fragments, s.fragment_sync_delay, s.fragment_update_alpha) == (4, 1, 0.25)
    assert s.diloco_sync.streaming and s.diloco_sync.schedule.every == 2
    assert not DiLoCo(inner_steps=8).diloco_sync.streaming


def test_compose_passes_the_options_to_the_diloco_presets() -> None:
    from lightning_dist.strategies.compose import compose

    for layout, cls in (("replicated", DiLoCo), ("hybrid", ShardedDiLoCo)):
        s = compose(layout=layout, sync="diloco", inner_steps=4, fragments=2, fragment_sync_delay=1)
        assert isinstance(s, cls) and (s.fragments, s.fragment_sync_delay) == (2, 1)


def test_more_fragments_than_parameters_fail_at_setup() -> None:
    sync = DiLoCo(inner_steps=4, fragments=4).diloco_sync
    with pytest.raises(ValueError, match="fragments=4 is more than the 2 parameters"):
        sync.start(list(torch.nn.Linear(2, 1).named_parameters()))


def test_fragments_are_contiguous_and_within_one_parameter_of_an_equal_share() -> None:
    assert split_fragments([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert split_fragments([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([1, 1, 10], 3) == [[0], [1], [2]]
    assert split_fragments([5], 1) == [[0]]
    with pytest.raises(ValueError, match="fragments=3 is more than the 2 parameters"):
        split_fragments([1, 2], 3)
    numels = [p.numel() for p in TinyCausalLM(WorkloadConfig.tiny(seed=7)).parameters()]
    for p in (2, 3, 4, 8):
        plan = split_fragments(numels, p)
        assert [i for f in plan for i in f] == list(range(len(numels)))
        for f in plan:
            assert abs(sum(numels[i] for i in f) - sum(numels) / p) <= 2 * max(numels)


# -- 2 processes over Gloo ----------------------------------------------------------------------
def weights(out: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.rank{rank}.pt")


def info(out: Path, name: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


H4 = {"inner_steps": 4}
P1 = {"fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}
STREAM = {**H4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
"""Fragment 0 starts after step 1 and lands after step 2, fragment 1 after steps 3 and 4, ..."""
RESUME = {"options": STREAM, "batches_per_epoch": 5}
"""The end of epoch 1 is step 5: fragment 0's exchange is in flight there."""
FIXTURE_BUDGET = 240
"""Seconds for the launch, at most half the timeout of each test that asks for it."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("streaming")
    ckpt = str(out / "epoch1.ckpt")
    runs: list[dict[str, Any]] = [
        {"name": "legacy", "strategy": "legacy", "options": H4, "steps": 8},
        {"name": "omitted", "options": H4, "steps": 8, "record_step_bytes": True},
        {
            "name": "p1",
            "options": {**H4, **P1},
            "steps": 8,
        },
        {"name": "stream", "options": STREAM, "steps": 7, "record_batches": True, "record_step_bytes": True},
        {"name": "p4", "options": {**H4, "fragments": 4}, "steps": 8, "record_step_bytes": True},
        {"name": "full", "epochs": 2, "save": ckpt, "save_at_epoch": 0, **RESUME},
        {"name": "resumed", "epochs": 2, "resume": ckpt, **RESUME},
        {"name": "stopped", "options": STREAM, "steps": 20, "stop_at": 5},
        {"name": "int8", "options": {**STREAM, "compression": "int8"}, "steps": 7},
    ]
    run_script([SCRIPT, "--out", str(out), "--runs", json.dumps(runs)], timeout=FIXTURE_BUDGET)
    return out


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_one_fragment_no_delay_no_mixing_is_diloco_bitwise(trained: Path) -> None:
    for rank in (0, 1):
        legacy = weights(trained, "legacy", rank)
        for name in ("omitted", "p1"):
            assert_same_weights(weights(trained, name, rank), legacy, atol=0)
            for key in ("syncs", "sync_bytes", "buffer_bytes", "inner_step"):
                assert info(trained, name, rank)[key] == info(trained, "legacy", rank)[key], (name, key)
    assert info(trained, "p1")["syncs"] == 2


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_two_fragments_overlapped_and_mixed_match_a_float64_reference(trained: Path) -> None:
    start = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    names = [n for n, _ in TinyCausalLM(WorkloadConfig.tiny(seed=7)).named_parameters()]
    numels = [p.numel() for p in TinyCausalLM(WorkloadConfig.tiny(seed=7)).parameters()]
    fragments = [[names[i] for i in f] for f in split_fragments(numels, 2)]
    batches = [torch.load(trained / f"stream.rank{r}.batches.pt") for r in (0, 1)]
    assert len(batches[0]) == 7 and not torch.equal(batches[0][0][0], batches[1][0][0])
    args = (0.7, 0.9, LR, WEIGHT_DECAY)
    expected = references.streaming_diloco(start, batches, 4, fragments, 1, 0.5, *args)[0]
    got = weights(trained, "stream")
    atol = 5e-4  # float32 AdamW and outer steps against float64 anchors, 7 steps (DiLoCo's H=4 bound)
    print(f"stream: max abs diff to the reference {max_abs_diff(got, expected):.3g}")
    assert_same_weights(got, expected, atol=atol)
    # syncs: fragment 0 at 2 and 6, fragment 1 at 4, the tail (both) at 7
    assert info(trained, "stream")["syncs"] == 4 and info(trained, "stream")["inner_step"] == 0
    for label, delay, alpha in (("no overlap", 0, 0.5), ("no mixing", 1, 0.0)):
        other = references.streaming_diloco(start, batches, 4, fragments, delay, alpha, *args)[0]
        print(f"stream vs {label}: max abs diff {max_abs_diff(got, other):.3g}")
        assert max_abs_diff(got, other) > 10 * atol, label


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_peak_bytes_per_step_are_one_pth_of_diloco(trained: Path) -> None:
    """The largest step of DiLoCo sends the whole model's exchange; with P fragments no step but the
    last (the tail: every fragment that moved since its sync) sends more than the largest fragment's."""
    numels = [p.numel() for p in TinyCausalLM(WorkloadConfig.tiny(seed=7)).parameters()]
    total = sum(numels)
    for rank in (0, 1):
        plain = info(trained, "omitted", rank)["step_bytes"]
        assert len(plain) == 8 and max(plain) > 4 * total  # fp32 pseudo-gradients of the whole model
        for name, p in (("stream", 2), ("p4", 4)):
            steps = info(trained, name, rank)["step_bytes"][:-1]
            largest = max(sum(numels[i] for i in f) for f in split_fragments(numels, p))
            share = largest / total
            assert share <= 1 / p + max(numels) / total  # contiguous cuts: within one parameter
            print(f"{name} rank {rank}: peak {max(steps)} B/step, DiLoCo's {max(plain)} (share {share:.3f})")
            assert max(steps) <= max(plain) * share * 1.01, name


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_resume_with_an_exchange_in_flight_is_bitwise_uninterrupted(trained: Path) -> None:
    saved = torch.load(trained / "epoch1.ckpt", weights_only=False)["lightning_dist.diloco"]
    assert saved["inner_step"] == 1 and saved["syncs"] == 2
    for own in saved["ranks"]:
        stream = own["stream"]
        assert stream["next_fragment"] == 0 and stream["pending"]["fragment"] == 0
    a, b = (own["stream"]["pending"]["averaged"] for own in saved["ranks"])
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "the landed average is the same"
    assert info(trained, "resumed")["global_step"] == info(trained, "full")["global_step"] == 10
    for rank in (0, 1):
        assert_same_weights(weights(trained, "resumed", rank), weights(trained, "full", rank), atol=0)
        assert info(trained, "resumed", rank)["syncs"] == info(trained, "full", rank)["syncs"]


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_every_rank_ends_on_the_same_weights(trained: Path) -> None:
    """The tail: at max_steps, max_epochs, and a callback's stop with an exchange in flight."""
    start = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    for name in ("stream", "p4", "full", "resumed", "stopped", "int8"):
        assert max_abs_diff(weights(trained, name, 0), start) > 1e-3, name
        assert_same_weights(weights(trained, name, 1), weights(trained, name, 0), atol=0)
        assert info(trained, name)["inner_step"] == 0
    assert info(trained, "stopped")["global_step"] == 5
    # int8 pseudo-gradients per fragment (their own compressor keys): fewer bytes, near the fp32 run
    assert info(trained, "int8")["sync_bytes"] < 0.4 * info(trained, "stream")["sync_bytes"]
    drift = max_abs_diff(weights(trained, "int8"), weights(trained, "stream"))
    print(f"int8 vs fp32 pseudo-gradients: max abs diff {drift:.3g}")
    assert drift < 1e-2


SHARDED = {"model": "mlp", "optimizer": "adamw", "lr": 0.01, "batches_per_epoch": 5}
SHARDED_STREAM = {**STREAM, "replicas": 2}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded_streaming")
    ckpt = str(out / "epoch1.ckpt")
    runs: list[dict[str, Any]] = [
        {
            "name": "full",
            "epochs": 2,
            "save": ckpt,
            "save_at_epoch": 0,
            "snapshot_as": "first",
            "options": SHARDED_STREAM,
            **SHARDED,
        },  # fmt: skip
        {"name": "resumed", "epochs": 2, "resume": ckpt, "options": SHARDED_STREAM, **SHARDED},
        {"name": "plain", "epochs": 2, "options": {**H4, "replicas": 2}, **SHARDED},
        {"name": "p1", "epochs": 2, "options": {**H4, "replicas": 2, **P1}, **SHARDED},
    ]
    run_script(
        [SHARDED_SCRIPT, "--out", str(out), "--devices", "2", "--runs", json.dumps(runs)],
        timeout=FIXTURE_BUDGET,
    )
    return out


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_sharded_diloco_streams_resumes_bitwise_and_ends_synced(sharded: Path) -> None:
    def w(name: str, rank: int) -> dict[str, torch.Tensor]:
        return dict(torch.load(sharded / f"{name}.rank{rank}.pt")["weights"])

    first = json.loads((sharded / "first.rank0.json").read_text())
    assert first["inner_step"] == 1 and first["syncs"] == 2
    for rank in (0, 1):
        assert_same_weights(w("resumed", rank), w("full", rank), atol=0)
    assert_same_weights(w("full", 1), w("full", 0), atol=0)
    for rank in (0, 1):  # the defaults spelled out: ShardedDiLoCo as it was
        assert_same_weights(w("p1", rank), w("plain", rank), atol=0)
    drift = max_abs_diff(w("full", 0), w("plain", 0))
    print(f"sharded streaming vs DiLoCo: max abs diff {drift:.3g}")
    assert drift > 0 and math.isfinite(drift)
    got = json.loads((sharded / "full.rank0.json").read_text())
    plain = json.loads((sharded / "plain.rank0.json").read_text())
    assert got["sync_bytes"] > 0 and plain["sync_bytes"] > 0


ELASTIC_STREAM = ["--diloco", "4", "--diloco-fragments", "2"]
"""Commits every 3 steps: the one of step 3 is taken with fragment 1's exchange in flight."""


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_elastic_diloco_streams_and_a_killed_worker_resumes_bitwise(tmp_path: Path) -> None:
    fault_free, killed = tmp_path / "fault_free", tmp_path / "killed"
    proc = torchrun_proc(fault_free, *ELASTIC_STREAM, max_restarts=0, timeout=200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    proc = torchrun_proc(killed, *ELASTIC_STREAM, "--kill-rank", "1", "--kill-step", "5", timeout=200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in (0, 1):
        facts = json.loads((killed / f"rank{rank}.json").read_text())
        assert facts["attempt"] == 1 and facts["global_step"] == STEPS and facts["resumed_from"] == 3
        got, expected = torch.load(killed / f"rank{rank}.pt"), torch.load(fault_free / f"rank{rank}.pt")
        assert_same_weights(got, expected, atol=0)
    assert_same_weights(torch.load(fault_free / "rank1.pt"), torch.load(fault_free / "rank0.pt"), atol=0)
