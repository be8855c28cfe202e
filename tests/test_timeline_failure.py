"""The trace of a run that failed: ``Timeline`` writes what every rank has when fit raises, when a
collective times out and when the process receives SIGTERM, one Chrome trace per attempt.

Fast: in-flight and timed-out calls in the recorder (threaded Gloo ranks, a 1 s timeout), the merge
of rank files and the attempt numbering, and 1-process fits that raise or signal themselves.
Slow (2 processes): both ranks raise at step 2 (the launch shared with
tests/test_straggler_report.py); rank 1 stops itself (SIGSTOP) so rank 0's next collective times out;
SIGTERM to a training process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import SCRIPTS, run_in_sequence, spawned

from lightning_dist.callbacks import Timeline
from lightning_dist.callbacks import failure_trace as failure
from lightning_dist.callbacks.timeline import chrome_trace
from lightning_dist.collectives import CommStats, Communicator, TorchBackend, trace
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

BUDGET = 150
"""Seconds for one 2-process launch, at most half the 300 s test timeout."""
FAIL_STEP = 2


def failed_events(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in data["traceEvents"] if e.get("cat") == "collective,failed"]


def steps_of(data: dict[str, Any], pid: int) -> set[int]:
    """The steps of rank ``pid`` whose batch ended (a ``train_batch`` span, not the unfinished one)."""
    return {
        e["args"]["step"]
        for e in data["traceEvents"]
        if e["pid"] == pid and e["name"] == "train_batch" and not e["args"].get("unfinished")
    }


# -- the recorder --------------------------------------------------------------------------------------
def test_a_call_in_flight_is_exported_as_such() -> None:
    rec = trace.Recorder()
    key = rec.posted("all_reduce", trace.now_ns(), 0, 2, "MainThread", "sum, 3 float32 elements")
    (event,) = [trace.CollectiveEvent(*e) for e in rec.export()["events"]]
    assert event.status == "in flight" and event.end_ns >= event.start_ns and event.op == "all_reduce"
    rec.collective("all_reduce", event.start_ns, event.start_ns + 5, 8, 8, 0, 2, "MainThread", "", "", key)
    assert rec.open == {} and [trace.CollectiveEvent(*e).status for e in rec.export()["events"]] == [""]
    data = chrome_trace([{"rank": 0, **rec.export()}])
    assert failed_events(data) == []


def test_a_timed_out_collective_is_marked_in_the_trace() -> None:
    """Rank 1 never joins; rank 0's all_reduce times out (1 s): its event says so."""
    store, prefix = dist.HashStore(), uuid.uuid4().hex
    errors: list[Optional[BaseException]] = [None]
    ready = threading.Barrier(2)

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, 2, timedelta(seconds=1))
        comm = Communicator(TorchBackend(group), stats=CommStats())
        comm.barrier()
        ready.wait()
        if r == 0:
            try:
                comm.all_reduce(torch.ones(3))
            except BaseException as exc:  # noqa: BLE001  (checked below)
                errors[0] = exc
        else:
            time.sleep(1.3)

    with trace.recording() as rec:
        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors[0] is not None
    mine = [e for e in rec.events if e.rank == 0 and e.op == "all_reduce"]
    assert [e.status for e in mine] == ["timed out"] and rec.open == {}
    data = chrome_trace([{"rank": 0, **rec.export()}])
    (marked,) = failed_events(data)
    assert (
        marked["name"] == "all_reduce (timed out)" and marked["args"]["detail"] == "sum, 3 float32 elements"
    )
    assert any(e["ph"] == "i" and e["name"] == "all_reduce timed out" for e in data["traceEvents"])


# -- files and attempts ------------------------------------------------------------------------------
def test_rank_files_merge_into_one_trace_per_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "timeline.json"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert failure.attempt_from_env() is None and failure.next_attempt(path) == 0
    for r in (1, 0):
        rec = trace.Recorder()
        rec.span("train_batch", 0, 10, step=0, batch_idx=0)
        rec.collective("all_reduce", 1, 5, 8, 8, r, 2, "MainThread", "sum")
        failure.write_rank(path, 0, {"rank": r, "reason": f"boom {r}", **rec.export()})
        data = failure.merge_attempt(path, 0, chrome_trace)
    assert data is not None
    merged = json.loads(failure.attempt_path(path, 0).read_text())
    assert merged == data and merged["otherData"]["reasons"] == {"0": "boom 0", "1": "boom 1"}
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert failure.attempt_path(path, 0).name == "timeline-attempt-0.json"
    assert failure.next_attempt(path) == 1, "one more than the attempts already traced"
    assert failure.merge_attempt(path, 5, chrome_trace) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert failure.attempt_from_env() == 3


class FailsAt(L.Callback):
    """Raises (``how="raise"``) or sends this process SIGTERM (``"sigterm"``) at step ``FAIL_STEP``."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == FAIL_STEP:
            if self.how == "raise":
                raise RuntimeError("injected")
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("how", ["raise", "sigterm"])
def test_one_process_fit_that_fails_writes_its_trace(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    L.seed_everything(7, verbose=False)
    timeline = Timeline(tmp_path / "timeline.json")
    trainer = quiet_trainer(
        accelerator="cpu", devices=1, max_steps=5, limit_val_batches=0, callbacks=[timeline, FailsAt(how)]
    )
    with pytest.raises(BaseException) as info:
        trainer.fit(TinyCausalLM(WorkloadConfig.tiny(seed=7)))
    assert not (tmp_path / "timeline.json").exists(), "no end-of-fit trace"
    path = tmp_path / "timeline-attempt-0.json"
    assert timeline.failure_path == path
    data = json.loads(path.read_text())
    # a signal: Lightning ends the batch it is in, then stops
    assert steps_of(data, 0) == set(range(FAIL_STEP if how == "raise" else FAIL_STEP + 1))
    reason = data["otherData"]["reasons"]["0"]
    if how == "raise":
        assert reason == "RuntimeError: injected"
    else:
        assert type(info.value).__name__ == "SIGTERMException"
        assert reason.startswith("signal SIGTERM; then SIGTERMException"), reason
    assert signal.getsignal(signal.SIGTERM) == before, "the handler is restored after fit"
    assert trace.active is None


# -- two processes -------------------------------------------------------------------------------------
def shared_launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process launch: the straggler fit, then the fit where both ranks raise at step 2."""
    root = tmp_path_factory.getbasetemp() / "straggler_launch"
    if not (root / "raise" / "rank1.json").exists():
        root.mkdir(exist_ok=True)
        run_in_sequence(
            [
                ["straggler_run.py", "--mode", "straggler", "--out", str(root / "straggler")],
                [
                    "straggler_run.py",
                    "--mode",
                    "raise",
                    "--fail-step",
                    str(FAIL_STEP),
                    "--out",
                    str(root / "raise"),
                ],
            ],
            BUDGET,
        )
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_launch(tmp_path_factory)


def check_trace(path: Path, ranks: set[int]) -> dict[str, Any]:
    """Valid Chrome trace JSON with process tracks of ``ranks`` and events with the keys viewers need."""
    data = json.loads(path.read_text())
    assert isinstance(data["traceEvents"], list) and data["otherData"]["failed"] is True
    names = {e["pid"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == ranks
    for e in data["traceEvents"]:
        assert {"ph", "name", "pid"} <= set(e) and e["ph"] in ("X", "i", "M")
        if e["ph"] != "M":
            assert isinstance(e["ts"], float) and isinstance(e["tid"], int)
    return data


@pytest.mark.slow
def test_raise_in_training_step_writes_both_ranks(runs: Path) -> None:
    out = runs / "raise"
    for r in (0, 1):
        assert json.loads((out / f"rank{r}.json").read_text())["error"] == "RuntimeError"
    data = check_trace(out / "timeline-attempt-0.json", {0, 1})
    for pid in (0, 1):
        assert steps_of(data, pid) == set(range(FAIL_STEP)), "every step up to the failure"
        assert any(e["pid"] == pid and e.get("cat") == "collective" for e in data["traceEvents"])
        assert data["otherData"]["reasons"][str(pid)] == f"RuntimeError: injected failure at step {FAIL_STEP}"
    assert not (out / "timeline.json").exists()


@pytest.mark.slow
def test_a_collective_timeout_marks_the_failing_call(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) in training_step at step 3: rank 0's loss all-reduce times out
    (5 s); its trace marks that call. Rank 1 cannot write: the trace has rank 0's events."""
    cmd = [
        "python", str(SCRIPTS / "stopped_rank.py"), "--timeout", "5", "--stop-rank", "1", "--stop-step", "3",
        "--stop-at", "training_step", "--out", str(tmp_path), "--timeline", str(tmp_path / "timeline.json"),
    ]  # fmt: skip
    import sys

    cmd[0] = sys.executable
    with spawned(cmd, tmp_path / "log.txt"):
        deadline = time.monotonic() + BUDGET
        while not (tmp_path / "rank0.error.json").exists():
            assert time.monotonic() < deadline, (tmp_path / "log.txt").read_text()[-4000:]
            time.sleep(0.5)
    data = check_trace(tmp_path / "timeline-attempt-0.json", {0})
    (marked,) = failed_events(data)
    assert marked["name"] == "all_reduce (timed out)" and marked["pid"] == 0
    assert steps_of(data, 0) == {0, 1, 2}
    assert data["otherData"]["reasons"]["0"].startswith("CollectiveTimeout: collective all_reduce")


@pytest.mark.slow
def test_sigterm_writes_the_trace(tmp_path: Path) -> None:
    """SIGTERM to rank 0 (Lightning passes it on to rank 1): both ranks write, the trace says why."""
    import sys

    cmd = [sys.executable, str(SCRIPTS / "straggler_run.py"), "--mode", "sigterm", "--out", str(tmp_path)]
    with spawned(cmd, tmp_path / "log.txt") as proc:
        deadline = time.monotonic() + BUDGET
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "log.txt").read_text()[
                -4000:
            ]
            time.sleep(0.5)
        os.kill(int((tmp_path / "rank0.pid").read_text()), signal.SIGTERM)
        proc.wait(60)
    data = check_trace(tmp_path / "timeline-attempt-0.json", {0, 1})
    for pid in (0, 1):
        assert len(steps_of(data, pid)) >= 2
        assert data["otherData"]["reasons"][str(pid)].startswith("signal SIGTERM"), data["otherData"][
            "reasons"
        ]
