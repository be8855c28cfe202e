"""HorovodElastic under Horovod's elastic engine (``horovodrun --min-np 1 --max-np 2
--host-discovery-script``, Gloo controller), two CPU workers on this machine as two hosts
(``localhost`` and ``127.0.0.1``, both local addresses: no ssh). One run loses a host, gets it back,
then loses a worker to SIGKILL; it reads every sample once, the same samples per step as a fault-free
run (one process, the same global batch), and ends on that run's weights."""

from __future__ import annotations

import collections
import json
import stat
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from helpers import (
    ROOT,
    SCRIPTS,
    assert_same_weights,
    concurrently,
    load_rank,
    run_command,
    runs_test,
    selected_cases,
)
from test_elastic import final_trajectory, sample_log

from lightning_dist.strategies.horovod_elastic import HorovodElastic

hvd = pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")

STEPS, GLOBAL_BATCH = 14, 8
"""The tiny workload's batch is 4 per rank: 8 samples a step, set at world size 2 (world size 1
reads them as two micro-batches)."""
BOTH, ONE = "localhost:1,127.0.0.1:1", "localhost:1"
REMOVE_AFTER, ADD_AFTER, KILL_AFTER = 2, 5, 8
"""Rank 0 drops 127.0.0.1 from the discovered hosts after step 2 (at world size 2), puts it back
after the first step >= 5 at world size 1; rank 1 SIGKILLs itself after its first step >= 8 (before
that step's commit), at world size 2 again."""
STEP_SLEEP = 0.5
"""Seconds each micro-batch waits: Horovod's driver polls the discovery script every second and
notifies the workers, who see the change at their next commit (every step here)."""
ATOL = 1e-6
"""At world size 1 Lightning sums two halved micro-batch gradients, at 2 Horovod averages two rank
gradients: the same samples in another rounding order (measured: bitwise equal on this workload)."""
GLOO_TIMEOUT = 120
"""Horovod's Gloo rendezvous timeout (default 30 s): a reset waits this long for a worker that joins,
and a new process (torch, Lightning) took over 30 s to start here under load; past it every worker
aborts (``gloo::IoException``) and the job fails."""
BUDGET = 240
"""Seconds for one launch: the elastic one took 35-41 s on 2 cores at load 3, 50-150 s at load 8-14."""


def horovodrun(out: Path, *args: str) -> list[str]:
    """The elastic launch of tests/scripts/hvd_elastic.py into ``out``, both hosts discovered."""
    out.mkdir(parents=True)
    (out / "hosts").write_text(BOTH.replace(",", "\n") + "\n")
    discover = out / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {out / 'hosts'}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IXUSR)
    return ["horovodrun", "-np", "2", "--min-np", "1", "--max-np", "2", "--network-interface", "lo",
            "--host-discovery-script", str(discover), sys.executable, str(SCRIPTS / "hvd_elastic.py"),
            "--out", str(out), "--max-steps", str(STEPS), "--step-sleep", str(STEP_SLEEP), *args]  # fmt: skip


def plain_fit(out: Path, steps: int = STEPS) -> list[str]:
    """One process, no elastic engine, reading each step's global batch of 8 as two micro-batches of
    4 (what every world size does with it: world size 1 is one of the elastic run's), into ``out``;
    it resumes from the newest commit in ``out`` (``HorovodElastic``'s disk commits, as ``Elastic``)."""
    out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, str(SCRIPTS / "hvd_elastic.py"), "--plain", "--accumulate", "2",
            "--out", str(out), "--max-steps", str(steps)]  # fmt: skip


def launch(cmd: list[str], out: Path, budget: float = BUDGET, **env: str) -> str:
    """Run ``cmd`` within ``budget`` seconds (its output kept in ``out``/horovodrun.log); "" when it
    exited 0, else the exit code and the workers' error lines (or the budget's error, with the output)."""
    try:
        proc = run_command(cmd, budget, ROOT, HOROVOD_GLOO_TIMEOUT_SECONDS=str(GLOO_TIMEOUT), **env)
    except AssertionError as exc:  # killed at the budget
        return str(exc)
    (out / "horovodrun.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode == 0:
        return ""
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "rror" in line or "what()" in line]
    return f"exit {proc.returncode}\n" + "\n".join(errors[-30:]) + f"\n{proc.stderr[-2000:]}"


def worlds(out: Path) -> list[int]:
    """The world size of each fit attempt that trained a step, in order."""
    by_attempt = {e["incarnation"]: e["world"] for e in sample_log(out)}
    return [by_attempt[attempt] for attempt in sorted(by_attempt)]


def rank0_pids(out: Path) -> list[int]:
    """The process id of rank 0 in each fit attempt that trained a step, in order."""
    by_attempt = {}
    for path in out.glob("samples.pid*.jsonl"):
        pid = int(path.name.removeprefix("samples.pid").removesuffix(".jsonl"))
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["rank"] == 0:
                by_attempt[entry["incarnation"]] = pid
    return [by_attempt[attempt] for attempt in sorted(by_attempt)]


def runs_per_step(out: Path) -> dict[int, int]:
    """How many fits ran each step (a redone step ran in two)."""
    incarnations = collections.defaultdict(set)
    for e in sample_log(out):
        incarnations[e["step"]].add(e["incarnation"])
    return {step: len(runs) for step, runs in incarnations.items()}


RANK0_ON = {"localhost": "0", "127.0.0.1": "4"}
"""The PYTHONHASHSEED under which horovodrun ranks that host first (rank 0): Horovod orders new hosts
by iterating a set of their names. With 127.0.0.1 first, the removed host is rank 0's."""


def elastic_run(out: Path, rank0_on: str) -> str:
    """The elastic launch that loses a host, gets it back and loses a worker, rank 0 first on
    ``rank0_on``, into ``out``; ``launch``'s verdict."""
    changes = ["--hosts-file", str(out / "hosts"),
               "--set-hosts", f"{REMOVE_AFTER}:2:{ONE}", "--set-hosts", f"{ADD_AFTER}:1:{BOTH}",
               "--kill-rank", "1", "--kill-step", str(KILL_AFTER)]  # fmt: skip
    return launch(horovodrun(out, *changes), out, PYTHONHASHSEED=RANK0_ON[rank0_on])


def restarted_run(out: Path) -> str:
    """``plain_fit`` into ``out`` for half the steps, then again (a new job) to ``STEPS``, both within
    ``BUDGET``; the first failing ``launch``'s verdict."""
    deadline = time.monotonic() + BUDGET
    for steps in (STEPS // 2, STEPS):
        failed = launch(plain_fit(out, steps), out, budget=deadline - time.monotonic())
        if failed:
            return failed
    return ""


Verdicts = dict[str, tuple[Path, str]]
"""A launch's name -> its out folder and ``launch``'s verdict ("": it succeeded)."""


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Verdicts:
    """The fault-free run (``plain_fit`` of ``STEPS`` steps) and every launch this session's tests
    check, all at once (they mostly wait: on the slowed steps, the driver's discovery, the resets),
    each in its own folder (the elastic ones with their own hosts file and discovery script) within
    ``BUDGET``: "fault_free", each ``RANK0_ON`` host tested, "restarted"."""
    root = tmp_path_factory.mktemp("hvd_elastic")
    outs = {"fault_free": root / "fault_free"}
    calls: dict[str, Callable[[], str]] = {
        "fault_free": partial(launch, plain_fit(outs["fault_free"]), outs["fault_free"])
    }
    test = test_host_removed_added_and_worker_killed_keep_the_trajectory
    for (rank0_on,) in selected_cases(request, test, "rank0_on"):
        outs[rank0_on] = root / f"rank0_on_{rank0_on}" / "elastic"
        calls[rank0_on] = partial(elastic_run, outs[rank0_on], rank0_on)
    if runs_test(request, test_a_new_job_resumes_from_the_last_disk_commit):
        outs["restarted"] = root / "restarted"
        calls["restarted"] = partial(restarted_run, outs["restarted"])
    return {name: (outs[name], failed) for name, failed in concurrently(calls).items()}


@pytest.fixture(scope="module")
def reference(launched: Verdicts) -> Path:
    """The fault-free run of ``STEPS`` steps (``plain_fit``)."""
    out, failed = launched["fault_free"]
    assert not failed, failed
    return out


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.parametrize("rank0_on", list(RANK0_ON))
def test_host_removed_added_and_worker_killed_keep_the_trajectory(
    launched: Verdicts, reference: Path, rank0_on: str
) -> None:
    elastic, failed = launched[rank0_on]
    assert not failed, failed

    _, facts = load_rank(elastic, 0)
    assert facts["global_step"] == STEPS
    assert facts["resets"] == 3, "a removal, an addition, a failure"
    assert worlds(elastic) == [2, 1, 2, 1], "removed, added, killed: each a new fit attempt"
    assert worlds(reference) == [1]
    pids = rank0_pids(elastic)
    assert (pids[1] != pids[0]) == (rank0_on == "127.0.0.1"), f"rank 0 of each attempt: {pids}"

    trajectory = final_trajectory(elastic)
    assert sorted(trajectory) == list(range(STEPS))
    used = [s for step in trajectory.values() for s in step]
    assert len(used) == STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample lost or used twice"
    assert trajectory == final_trajectory(reference), "step s read the same samples on every world size"
    killed_after = int((elastic / "killed").read_text().split()[-1])
    redone = sorted(step for step, n in runs_per_step(elastic).items() if n > 1)
    assert redone == [killed_after - 1], "a host change redoes nothing; the kill redoes its uncommitted step"

    weights, _ = load_rank(elastic, 0)
    assert_same_weights(weights, load_rank(reference, 0)[0], atol=ATOL)
    assert facts["world_size"] == 1, "the killed worker's host stays blacklisted (no cooldown)"


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_a_new_job_resumes_from_the_last_disk_commit(launched: Verdicts, reference: Path) -> None:
    """The floor when every worker dies: rank 0 also wrote each commit to ``dirpath``, and a new job
    (no in-memory state) resumes from the newest one (``restarted_run``)."""
    out, failed = launched["restarted"]
    assert not failed, failed
    weights, facts = load_rank(out, 0)
    assert facts["global_step"] == STEPS and facts["resumed_from"] == STEPS // 2
    assert runs_per_step(out) == dict.fromkeys(range(STEPS), 1), "no step redone, none skipped"
    assert final_trajectory(out) == final_trajectory(reference)
    assert_same_weights(weights, load_rank(reference, 0)[0], atol=ATOL)


def test_lr_scale_auto_is_one_and_unknown_options_are_named() -> None:
    assert HorovodElastic()._auto_lr_scale() == 1.0
    assert HorovodElastic().commit_every == 1
    with pytest.raises(ValueError, match="HorovodElastic got unknown option.*commit_every"):
        HorovodElastic(commit_evry=2)


def test_wrapped_horovod_error_is_found() -> None:
    from horovod.common.exceptions import HorovodInternalError

    from lightning_dist.collectives.horovod_elastic import horovod_failure

    text = (
        "Got the following error when running the callback: HorovodInternalError: Horovod has been shut down"
    )
    found = horovod_failure(RuntimeError(text))
    assert isinstance(found, HorovodInternalError) and "shut down" in str(found)
    original = HorovodInternalError("broken pipe")
    try:
        try:
            raise original
        except HorovodInternalError as exc:
            raise ValueError("collective failed") from exc
    except ValueError as wrapped:
        assert horovod_failure(wrapped) is original
    assert horovod_failure(RuntimeError("CUDA out of memory")) is None
