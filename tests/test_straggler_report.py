"""The straggler report: per collective, who arrived last and how long the others waited.

Fast: the maths against hand-computed waits (``callbacks.stragglers``), the arrivals gathered over
threaded Gloo ranks where one rank sleeps before each call, the Timeline's "waits" track from
given events, and CommMonitor's option checks. Slow (one 2-process launch, shared with
tests/test_timeline_failure.py's raise case): rank 1 sleeps before each backward; the report names
it the straggler and rank 0's ``comm/wait_s`` adds up to at least half the sleeps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dist.callbacks import CommMonitor
from lightning_dist.callbacks.stragglers import StragglerReport, call_waits, gather_arrivals
from lightning_dist.callbacks.timeline import WAITS_TID, chrome_trace
from lightning_dist.collectives import Communicator, trace
from lightning_dist.testing import run_in_threads

BUDGET = 150
"""Seconds for the shared 2-process launch (two short fits), at most half the 300 s test timeout."""
SLEEP_S = 0.2
"""What rank 1 sleeps before each backward in the slow run (tests/scripts/straggler_run.py)."""


# -- maths ---------------------------------------------------------------------------------------
def test_call_waits_of_one_call() -> None:
    w = call_waits([100, 350, 200])
    assert w.last_ns == 350 and w.straggler == 1 and w.wait_ns == (250, 0, 150)
    tie = call_waits([5, 5])
    assert tie.straggler == 0 and tie.wait_ns == (0, 0), "a tie names the lowest rank"
    with pytest.raises(ValueError, match="starts"):
        call_waits([])


def test_report_adds_waits_and_counts_the_last_rank() -> None:
    calls = [[0, 10, 4], [0, 7, 9], [3, 20, 1], [2, 2, 2]]
    report = StragglerReport(3)
    for starts in calls:
        report.add(starts)
    # reference: the formula, call by call
    waits = [sum(max(c) - c[r] for c in calls) for r in range(3)]
    lasts = [sum(1 for c in calls if c.index(max(c)) == r) for r in range(3)]
    assert report.calls == 4 and report.wait_ns == waits and report.last_count == lasts
    assert report.straggler() == 1 and report.last_share(1) == pytest.approx(2 / 4)
    assert report.wait_s(0) == pytest.approx(waits[0] / 1e9)
    assert report.wait_share(0) is None, "no step time given"
    report.step_seconds = [1e-7, 1e-7, 0.0]
    assert report.wait_share(0) == pytest.approx(waits[0] / 1e9 / 1e-7) and report.wait_share(2) is None
    table = report.table()
    assert "rank 1 was last at 50% of 4 collectives" in table and len(table.splitlines()) == 5
    other = StragglerReport(3)
    other.add([0, 0, 5])
    report.merge(other)
    assert report.calls == 5 and report.last_count[2] == lasts[2] + 1
    with pytest.raises(ValueError, match="3 arrival times"):
        report.add([1, 2])
    with pytest.raises(ValueError, match="world_size"):
        StragglerReport(0)


def test_no_calls_no_straggler() -> None:
    report = StragglerReport(2)
    assert report.straggler() is None and report.last_share(0) == 0.0
    assert "was last" not in report.table()


# -- arrivals over real ranks --------------------------------------------------------------------------
def test_arrivals_gathered_over_threaded_ranks_name_the_sleeper() -> None:
    calls, sleep = 4, 0.05

    def body(comm: Communicator) -> tuple[list[list[int]], Any, int]:
        comm.arrivals.start()
        for _ in range(calls):
            if comm.rank == 1:
                time.sleep(sleep)
            comm.all_reduce(torch.ones(3))
        comm.barrier()
        entries = comm.arrivals.take()
        before = comm.stats.calls
        matrix, steps = gather_arrivals(comm, entries, step_seconds=1.0 + comm.rank)
        assert comm.arrivals.take() == [], "the gather's own calls are not recorded"
        return matrix, steps, comm.stats.calls - before

    results = run_in_threads(2, body)
    (m0, steps0, gather_calls), (m1, _, _) = results
    assert m0 == m1 and len(m0) == calls + 1, "every all_reduce and the barrier, matched by number"
    assert steps0 == [1.0, 2.0]
    assert gather_calls == 2, "the shape exchange, then the data"
    report = StragglerReport(2)
    for starts in m0[:calls]:
        report.add(starts)
    assert report.last_count == [0, calls], "rank 1 sleeps before each call: always last"
    assert report.wait_s(0) >= 0.5 * sleep * calls
    assert report.wait_s(1) == 0


def test_arrivals_off_by_default_record_nothing() -> None:
    def body(comm: Communicator) -> list[Any]:
        comm.all_reduce(torch.ones(2))
        return comm.arrivals.take()

    assert run_in_threads(2, body) == [[], []]


def test_timeline_waits_track_from_events() -> None:
    def part(rank: int, starts: list[int]) -> dict[str, Any]:
        rec = trace.Recorder()
        rec.clock_offset_ns = 0
        for s in starts:
            rec.collective("all_reduce", s, s + 10_000, 8, 8, rank, 2, "MainThread", "sum")
        rec.collective("send", 0, 1, 8, 0, rank, 2, "MainThread", "p2p")  # not a collective
        return {"rank": rank, **rec.export()}

    data = chrome_trace([part(0, [1_000, 50_000]), part(1, [5_000, 40_000])])
    json.dumps(data)
    waits = [e for e in data["traceEvents"] if e.get("tid") == WAITS_TID and e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["dur"]) for e in waits] == [
        (0, "wait for rank 1", 4.0),
        (1, "wait for rank 0", 10.0),
    ]
    names = {
        e["pid"] for e in data["traceEvents"] if e["name"] == "thread_name" and e["args"]["name"] == "waits"
    }
    assert names == {0, 1}
    s = data["otherData"]["stragglers"]
    assert s["calls"] == 2 and s["last_share"] == [0.5, 0.5] and s["wait_s"] == pytest.approx([4e-6, 1e-5])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_comm_monitor_refuses_bad_stragglers(bad: Any) -> None:
    with pytest.raises(ValueError, match="stragglers="):
        CommMonitor(stragglers=bad)


def test_world_size_one_has_no_report(tmp_path: Path) -> None:
    import lightning as L

    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    L.seed_everything(7, verbose=False)
    monitor = CommMonitor(stragglers=1)
    trainer = quiet_trainer(
        accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, callbacks=[monitor]
    )
    trainer.fit(TinyCausalLM(WorkloadConfig.tiny(seed=7)))
    assert monitor.straggler_report is None and all("comm/wait_s" not in h for h in monitor.history)


# -- two processes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch: the straggler fit, then the fit that raises (tests/test_timeline_failure.py)."""
    from test_timeline_failure import shared_launch

    return shared_launch(tmp_path_factory)


@pytest.mark.slow
def test_rank_one_sleeping_is_the_straggler(runs: Path) -> None:
    out = runs / "straggler"
    info = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    steps = info[0]["global_step"]
    for i in info:
        report = i["report"]
        assert report["calls"] >= steps, "at least the gradient all-reduce of each step"
        assert report["last_count"][1] >= 0.8 * report["calls"], report
    assert info[0]["report"] == info[1]["report"], "every rank holds the same report"
    wait0 = info[0]["wait_s_logged"]
    assert sum(wait0) * info[0]["interval"] >= 0.5 * SLEEP_S * steps, wait0
    assert set(info[0]["straggler_logged"]) == {1.0}
    assert "rank 1 was last at" in info[0]["table"]
    timeline = json.loads((out / "timeline.json").read_text())
    waited = timeline["otherData"]["stragglers"]["wait_s"]
    assert waited[0] > waited[1], "the Timeline's waits track agrees (over every call it traced)"
    waits = [
        e for e in timeline["traceEvents"] if e.get("tid") == WAITS_TID and e["ph"] == "X" and e["pid"] == 0
    ]
    assert sum(e["dur"] for e in waits) / 1e6 >= 0.5 * SLEEP_S * steps
