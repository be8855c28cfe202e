"""``collectives.trace`` and ``callbacks.Timeline``: the recorder over threaded Gloo ranks and a
1-process fit (fast); 2-process fits with DDP, Compressed("powersgd") and Horovod whose merged
Chrome trace is loaded and checked for both ranks (slow)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MPIRUN_TWO_RANKS, SCRIPTS, load_rank, run_command, run_in_sequence

from lightning_dist import collectives
from lightning_dist.callbacks import Timeline
from lightning_dist.callbacks.timeline import chrome_trace
from lightning_dist.collectives import Communicator, trace
from lightning_dist.testing import run_in_threads

BUDGET = 120
"""Seconds for one 2-process launch (about 10 s for one run on 2 shared cores), at most half the
300 s test timeout."""
EPS_US = 1e-3
"""Float slack when comparing microsecond timestamps computed from different offsets."""


# -- the recorder ------------------------------------------------------------------------------
def _ops(comm: Communicator) -> dict[str, float]:
    comm.all_reduce(torch.ones(6), "sum")
    futs = [comm.all_reduce_async(torch.ones(4 + i), "avg") for i in range(3)]
    for f in futs:
        f.wait()
    comm.broadcast(torch.zeros(5), 0)
    comm.broadcast_object({"rank": comm.rank}, 1)
    comm.all_gather(torch.ones(comm.rank + 1, 2))  # unequal shapes: a shape exchange, then the data
    comm.barrier()
    return comm.stats.snapshot()


def test_recorder_records_every_call_of_both_ranks() -> None:
    assert trace.active is None, "tracing is off by default"
    with trace.recording() as rec:
        snaps = run_in_threads(2, _ops)
    assert trace.active is None
    by_rank: dict[int, list[trace.CollectiveEvent]] = {0: [], 1: []}
    for e in rec.events:
        by_rank[e.rank].append(e)
    for r, snap in enumerate(snaps):
        events = by_rank[r]
        ops = [e.op for e in sorted(events, key=lambda e: e.start_ns)]
        assert ops.count("all_reduce") == 4 and ops.count("broadcast") == 1
        assert ops.count("broadcast_object") == 1 and ops.count("barrier") == 1
        assert ops.count("all_gather") == 2, "the shape exchange is a call of its own"
        assert len(events) == snap["calls"], "one event per counted call"
        for field in ("bytes_sent", "bytes_received"):
            assert sum(getattr(e, field) for e in events) == snap[field], "the same wire model as stats()"
        for e in events:
            assert e.end_ns >= e.start_ns and e.world_size == 2 and e.thread
        reduces = [e for e in events if e.op == "all_reduce"]
        assert all(e.bytes_sent > 0 for e in reduces)
        assert "sum, 6 float32 elements" in {e.detail for e in reduces}


def test_tracing_off_records_nothing_and_world_size_one_is_silent() -> None:
    rec = trace.Recorder()
    run_in_threads(2, lambda comm: comm.all_reduce(torch.ones(3)))
    assert rec.events == []
    with trace.recording() as rec:
        comm = Communicator(collectives.SingleProcessBackend())
        comm.all_reduce(torch.ones(3))
        comm.barrier()
    assert rec.events == [], "world size 1 moves nothing"


def test_chrome_trace_lanes_never_overlap_and_ranks_are_processes() -> None:
    def part(rank: int, offset: int) -> dict[str, Any]:
        rec = trace.Recorder()
        rec.clock_offset_ns = offset
        rec.span("train_batch", 0, 10_000, step=0, batch_idx=0)
        rec.span("forward", 0, 4_000, step=0, batch_idx=0)
        for start, end in [(1_000, 5_000), (2_000, 3_000), (5_000, 6_000)]:  # two overlap
            rec.collective("all_reduce", start, end, 8, 8, rank, 2, "MainThread", "sum")
        return {"rank": rank, **rec.export()}

    data = chrome_trace([part(0, 1_000_000), part(1, 1_000_500)])
    json.dumps(data)  # plain JSON
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    rank1 = [e for e in events if e["pid"] == 1 and e["ph"] == "X"]
    assert min(e["ts"] for e in rank1) == pytest.approx(0.5), "Unix-time alignment across ranks"
    for pid in (0, 1):
        coll = [e for e in events if e["pid"] == pid and e.get("cat") == "collective"]
        assert len(coll) == 3 and {e["tid"] for e in coll} == {1, 2}
        for lane in (1, 2):
            spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in coll if e["tid"] == lane)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "a lane's events never overlap"
        assert all(e["args"]["bytes_sent"] == 8 and e["args"]["op"] == "all_reduce" for e in coll)


def test_timeline_single_process_fit(tmp_path: Path) -> None:
    import lightning as L

    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    L.seed_everything(7, verbose=False)
    path = tmp_path / "sub" / "timeline.json"
    timeline = Timeline(path)
    trainer = quiet_trainer(
        accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, callbacks=[timeline]
    )
    trainer.fit(TinyCausalLM(WorkloadConfig.tiny(seed=7)))
    assert trace.active is None, "recording stops with training"
    data = json.loads(path.read_text())
    assert data == timeline.trace
    steps = check_steps(data["traceEvents"], pid=0, steps=2)
    assert len(steps) == 2


# -- checks on a merged trace ---------------------------------------------------------------------
def check_steps(events: list[dict[str, Any]], pid: int, steps: int) -> dict[int, dict[str, dict[str, Any]]]:
    """Each step of rank ``pid``: a train_batch holding forward, backward, grad_sync and optimizer,
    in that order; returns {step: {span name: event}}."""
    spans: dict[int, dict[str, dict[str, Any]]] = {}
    for e in events:
        if e["pid"] == pid and e.get("cat") == "step":
            assert e["ph"] == "X" and e["dur"] >= 0
            assert e["name"] not in spans.setdefault(e["args"]["step"], {}), f"one {e['name']} per step"
            spans[e["args"]["step"]][e["name"]] = e
    assert sorted(spans) == list(range(steps))
    for step, s in spans.items():
        order = [s[n] for n in ("forward", "backward", "grad_sync", "optimizer")]
        batch = s["train_batch"]
        assert order[0]["ts"] == pytest.approx(batch["ts"]), f"step {step}"
        for a, b in zip(order, order[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + EPS_US, f"step {step}: {a['name']} before {b['name']}"
        end = batch["ts"] + batch["dur"]
        assert order[-1]["ts"] + order[-1]["dur"] <= end + EPS_US
    return spans


def check_trace(path: Path, steps: int, reduces_per_step: int | None, ops: tuple[str, ...]) -> None:
    """Both ranks' tracks, step spans, and the gradient collectives inside the steps."""
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for pid in (0, 1):
        spans = check_steps(events, pid, steps)
        coll = [e for e in events if e["pid"] == pid and e.get("cat") == "collective"]
        for e in coll:
            assert e["ph"] == "X" and e["dur"] >= 0 and e["tid"] >= 1
            assert e["args"]["op"] == e["name"] and e["args"]["world_size"] == 2
        for step, s in spans.items():
            backward, optimizer = s["backward"], s["optimizer"]
            # gradient exchanges: posted during backward, done before the optimizer step
            grads = [
                e
                for e in coll
                if e["name"] in ops and backward["ts"] <= e["ts"] <= backward["ts"] + backward["dur"] + EPS_US
            ]
            assert grads, f"rank {pid} step {step}: no {ops} posted in backward"
            if reduces_per_step is not None:
                assert len(grads) == reduces_per_step, f"rank {pid} step {step}: one per bucket"
            for e in grads:
                assert e["args"]["bytes_sent"] > 0 and e["args"]["bytes_received"] > 0
                assert e["ts"] + e["dur"] <= optimizer["ts"] + EPS_US, "complete before the optimizer step"


TWO_RANK_STRATEGIES = ("ddp", "powersgd")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process fit with each of ``TWO_RANK_STRATEGIES``, one after another in one launch."""
    root = tmp_path_factory.mktemp("timeline")
    run_in_sequence(
        [["timeline_run.py", "--strategy", s, "--out", str(root / s)] for s in TWO_RANK_STRATEGIES], BUDGET
    )
    return root


@pytest.mark.slow
@pytest.mark.parametrize("strategy", TWO_RANK_STRATEGIES)
def test_timeline_two_ranks(two_ranks: Path, strategy: str) -> None:
    out = two_ranks / strategy
    _, info = load_rank(out, 0)
    _, info1 = load_rank(out, 1)
    assert info["wrote_trace"] and not info1["wrote_trace"], "rank 0 writes the merged file"
    steps = info["global_step"]
    assert steps == 4 and info["hook_calls"] % steps == 0
    buckets = info["hook_calls"] // steps
    # DDP: one all-reduce per bucket; PowerSGD: at least one per bucket (P, then Q)
    check_trace(out / "timeline.json", steps, buckets if strategy == "ddp" else None, ("all_reduce",))


@pytest.mark.slow
@pytest.mark.horovod
def test_timeline_horovod(tmp_path: Path) -> None:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    out = tmp_path / "horovod"
    cmd = [
        *MPIRUN_TWO_RANKS,
        sys.executable,
        str(SCRIPTS / "timeline_run.py"),
        "--strategy",
        "horovod",
        "--out",
        str(out),
    ]
    proc = run_command(cmd, BUDGET)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    _, info = load_rank(out, 0)
    assert info["global_step"] == 4
    check_trace(out / "timeline.json", 4, None, ("all_reduce",))
