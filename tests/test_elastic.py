"""Elastic under torchrun (2 CPU workers, Gloo): a killed worker costs at most ``commit_every`` steps,
every sample is used once, and the final weights equal a fault-free run's."""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import pytest
import torch
from background import BackgroundJobs, Command, python_call
from helpers import (
    ROOT,
    SCRIPTS,
    assert_same_weights,
    concurrently,
    kill_tree,
    lanes_budget,
    max_abs_diff,
    run_command,
    run_in_sequence,
    runs_test,
    selected_cases,
    spawned,
)

from lightning_dist.elastic import commits

CHILD_PATH = os.pathsep.join([str(ROOT), str(SCRIPTS)])
"""The workers' PYTHONPATH: this checkout's package (not another one installed in the environment),
then the scripts' helpers."""

pytestmark = pytest.mark.slow
COMMIT_EVERY, STEPS, GLOBAL_BATCH = 3, 12, 8  # tiny workload: batch 4 per rank, 2 ranks


LAUNCH_BUDGET = 120
"""Seconds for one torchrun launch of a fault or resume scenario (its ``run_command`` budget)."""


def torchrun_proc(
    out: Path,
    *args: str,
    max_restarts: int = 1,
    timeout: float = LAUNCH_BUDGET,
    steps: int = STEPS,
    nproc: int = 2,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", str(SCRIPTS / "elastic_run.py"), "--out", str(out),
           "--commit-every", str(COMMIT_EVERY), "--max-steps", str(steps), *args]  # fmt: skip
    return run_command(cmd, timeout, PYTHONPATH=CHILD_PATH, **env)


Launch = Callable[[Path], subprocess.CompletedProcess[str]]
"""A launch into the out folder it is given."""
Ran = tuple[Path, Union[subprocess.CompletedProcess[str], str], float]
"""A launch's out folder, its process (or why it stopped: its budget ran out) and its seconds."""


AT_ONCE = 2
"""Launches that ``launch_all`` runs at the same time. One alone leaves part of the 2 cores idle while
it waits (start-ups, rendezvous, restarts); two fill them; more would only stretch every launch
towards its budget (on a loaded machine, past it)."""


def launch_all(root: Path, cases: dict[str, Launch], at_once: int = AT_ONCE) -> dict[str, Ran]:
    """Each of ``cases`` (name -> its launch, into ``root / name``), ``at_once`` at a time; name ->
    what it ran to (its seconds count from its own start, so each keeps its whole budget)."""

    def run(name: str, launch: Launch) -> Ran:
        out, start = root / name, time.monotonic()
        try:
            proc: Union[subprocess.CompletedProcess[str], str] = launch(out)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            proc = f"{type(exc).__name__}: {exc}"
        return out, proc, time.monotonic() - start

    calls = {name: functools.partial(run, name, launch) for name, launch in cases.items()}
    return concurrently(calls, at_once=at_once)


def launched(runs: dict[str, Ran], name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The out folder and process of ``runs[name]``; that case fails here if its launch did not end."""
    out, proc, _ = runs[name]
    assert not isinstance(proc, str), proc
    return out, proc


def torchrun_case(*args: str, **kwargs: Any) -> Launch:
    """``torchrun_proc`` with these arguments, into the folder it is given."""
    return lambda out: torchrun_proc(out, *args, **kwargs)


def sample_log(out: Path) -> list[dict[str, Any]]:
    """Every micro-batch any worker trained on (see tests/scripts/elastic_run.py)."""
    return [
        json.loads(line) for path in out.glob("samples.pid*.jsonl") for line in path.read_text().splitlines()
    ]


def final_trajectory(out: Path) -> dict[int, list[int]]:
    """Samples of every optimizer step as its last run read them (all ranks, sorted)."""
    log = sample_log(out)
    last = {}
    for entry in log:
        last[entry["step"]] = max(last.get(entry["step"], 0), entry["incarnation"])
    steps: dict[int, list[int]] = collections.defaultdict(list)
    for entry in log:
        if entry["incarnation"] == last[entry["step"]]:
            steps[entry["step"]].extend(entry["samples"])
    return {step: sorted(samples) for step, samples in steps.items()}


REDUCTIONS = {
    "average": [],
    "powersgd": ["--compression", "powersgd"],  # per-rank residuals and Q come back from the commit
    "adasum": ["--reduce-op", "adasum"],
}


@pytest.fixture(scope="module")
def fault_free(shared_torchrun: dict[str, Path]) -> dict[str, Path]:
    """The fault-free runs the tests compare with (tests/shared_runs.py, one torchrun launch): each
    reduction for ``STEPS`` and for ``SCALE_STEPS`` steps ("<reduction>" and "<reduction>_scale"),
    and the first parts of runs that tests continue: average for 7 steps ("stopped_after_7", commits
    3 and 6) and for 6 steps ("stopped_after_6")."""
    return shared_torchrun


def continued(fault_free: dict[str, Path], name: str, out: Path) -> Path:
    """A copy at ``out`` of the fault-free run ``name`` (its commits and logs), for a test to continue."""
    shutil.copytree(fault_free[name], out)
    return out


FAULTS = {
    **{f"sigkill-{r}": [*flags, "--kill-rank", "1", "--kill-step", "7"] for r, flags in REDUCTIONS.items()},
    "raise": ["--fault", "raise", "--kill-rank", "1", "--kill-step", "7"],
    "commit": ["--fault", "commit", "--kill-step", "6"],
}
"""The runs of ``STEPS`` steps with a fault (``torchrun_proc``'s flags): rank 1 SIGKILLed after step 7
(each reduction), rank 1 raising there, rank 0 killed while writing the commit of step 6."""
FAULTED_BUDGET = lanes_budget(len(FAULTS), LAUNCH_BUDGET, at_once=1)
"""Seconds for ``faulted``'s launches, one after another, each within ``LAUNCH_BUDGET``; the tests that
read them get twice that as their timeout (the shared fault-free runs may start there too)."""


@pytest.fixture(scope="module")
def faulted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """``launch_all`` of the ``FAULTS`` whose tests this session runs, one at a time: a fault run keeps
    both cores busy alone (its restart's start-up), and two at once, on a loaded machine, neared
    their budgets."""
    sigkill = test_sigkill_mid_epoch_resumes_from_the_last_commit
    names = [f"sigkill-{r}" for (r,) in selected_cases(request, sigkill, "reduction")]
    if runs_test(request, test_exception_on_one_rank_restarts_from_the_last_commit):
        names.append("raise")
    if runs_test(request, test_crash_while_writing_a_commit_resumes_from_the_previous_one):
        names.append("commit")
    cases = {name: torchrun_case(*FAULTS[name]) for name in names}
    return launch_all(tmp_path_factory.mktemp("faulted"), cases, at_once=1)


@pytest.mark.timeout(2 * FAULTED_BUDGET)
@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_sigkill_mid_epoch_resumes_from_the_last_commit(
    faulted: dict[str, Ran], fault_free: dict[str, Path], reduction: str
) -> None:
    out, proc = launched(faulted, f"sigkill-{reduction}")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    facts = json.loads((out / "rank0.json").read_text())
    assert facts["attempt"] == 1 and facts["global_step"] == STEPS
    assert facts["resumed_from"] == 6, "the newest commit before the kill at step 7"
    assert 7 - facts["resumed_from"] <= COMMIT_EVERY
    killed = final_trajectory(out)
    assert sorted(killed) == list(range(STEPS))
    used = [s for step in killed.values() for s in step]
    assert len(used) == STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample used twice"
    reference = fault_free[reduction]
    assert killed == final_trajectory(reference), "the same samples at every step as the fault-free run"
    assert any(e["rank"] == 1 and e["attempt"] == 0 for e in sample_log(out)), "the killed attempt logged"
    assert_same_weights(torch.load(out / "rank0.pt"), torch.load(reference / "rank0.pt"), atol=1e-6)


def assert_recovered(out: Path, fault_free: Path, resumed_from: int) -> None:
    """The run reached its last step from the commit of ``resumed_from``, read every sample once
    (the last run of each step), the same samples per step, and ended on the fault-free weights."""
    facts = json.loads((out / "rank0.json").read_text())
    assert facts["global_step"] == STEPS
    assert facts["resumed_from"] == resumed_from
    trajectory = final_trajectory(out)
    assert sorted(trajectory) == list(range(STEPS))
    used = [s for step in trajectory.values() for s in step]
    assert len(used) == STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample used twice"
    assert trajectory == final_trajectory(fault_free)
    assert_same_weights(torch.load(out / "rank0.pt"), torch.load(fault_free / "rank0.pt"), atol=1e-6)


@pytest.mark.timeout(2 * FAULTED_BUDGET)
def test_exception_on_one_rank_restarts_from_the_last_commit(
    faulted: dict[str, Ran], fault_free: dict[str, Path]
) -> None:
    out, proc = launched(faulted, "raise")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "injected fault on rank 1 after step 7" in proc.stderr, proc.stderr[-3000:]
    assert any(e["rank"] == 1 and e["attempt"] == 0 for e in sample_log(out))
    assert_recovered(out, fault_free["average"], resumed_from=6)


@pytest.mark.timeout(2 * FAULTED_BUDGET)
def test_crash_while_writing_a_commit_resumes_from_the_previous_one(
    faulted: dict[str, Ran], fault_free: dict[str, Path]
) -> None:
    out, proc = launched(faulted, "commit")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "cut to" in (out / "crashed_in_commit").read_text(), "rank 0 died inside the commit write"
    assert_recovered(out, fault_free["average"], resumed_from=3)


def _evil_payload(marker: Path) -> bytes:
    """A commit payload that would create ``marker`` if it were unpickled with full pickle."""

    class RunsCode:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    buffer = io.BytesIO()
    torch.save({"state_dict": RunsCode()}, buffer)
    return buffer.getvalue()


DAMAGES = ["truncated", "pickle"]


def damaged_run(fault_free: dict[str, Path], root: Path) -> subprocess.CompletedProcess[str]:
    """For each of ``DAMAGES``: a copy (``root / damage``) of a first run that stopped after step 7
    (commits 3 and 6) whose newest commit is damaged that way (the pickle payload would create
    ``root / "pickle_ran"``), then continued, both runs one after another in one torchrun launch (no
    restarts)."""
    root.mkdir()
    marker = root / "pickle_ran"
    for damage in DAMAGES:
        out = continued(fault_free, "stopped_after_7", root / damage)
        newest = out / "commits" / "commit-00000006.pt"
        if damage == "truncated":
            newest.write_bytes(newest.read_bytes()[: newest.stat().st_size * 2 // 3])
        else:
            payload = _evil_payload(marker)
            header = commits._HEADER.pack(
                commits._MAGIC, commits._VERSION, len(payload), hashlib.sha256(payload).digest()
            )
            newest.write_bytes(header + payload)
    runs = [["elastic_run.py", "--out", str(root / damage), "--commit-every", str(COMMIT_EVERY),
             "--max-steps", str(STEPS)] for damage in DAMAGES]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=0", str(SCRIPTS / "in_sequence.py"), json.dumps(runs)]  # fmt: skip
    return run_command(cmd, LAUNCH_BUDGET, PYTHONPATH=CHILD_PATH)


INDIVISIBLE = {"scaled": [], "unscaled": ["--no-scale-lr"]}
"""The two resumes of ``stopped_after_6`` on 3 ranks (``torchrun_proc``'s flags)."""


def indivisible_run(
    fault_free: dict[str, Path], flags: list[str], out: Path
) -> subprocess.CompletedProcess[str]:
    """A copy at ``out`` of the run that stopped after step 6 (at world size 2), resumed on 3 ranks."""
    return torchrun_proc(continued(fault_free, "stopped_after_6", out), *flags, steps=9, nproc=3)


INLINE = {"fault_free": "-1", "killed": "5"}
"""``run_elastic``'s runs (tests/scripts/elastic_inline.py): name -> rank 1's kill step."""


def inline_runs(root: Path) -> subprocess.CompletedProcess[str]:
    """``INLINE``'s runs (each in ``root / name``), one after another from one parent process."""
    for name in INLINE:
        (root / name).mkdir(parents=True)
    runs = [
        ["elastic_inline.py", "--out", str(root / name), "--kill-step", kill] for name, kill in INLINE.items()
    ]
    return run_in_sequence(runs, LAUNCH_BUDGET)


RESUMED_BUDGET = lanes_budget(4, LAUNCH_BUDGET, AT_ONCE)
"""Seconds for ``resumed``'s four launches, ``AT_ONCE`` at a time, each within ``LAUNCH_BUDGET``; the
tests that read them get twice that as their timeout."""


@pytest.fixture(scope="module")
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """``launch_all`` of the second group this session runs: the damaged-commit launch
    (``damaged_run``), the two resumes on 3 ranks (``indivisible_run``: "indivisible-<name>") and
    ``run_elastic``'s pair (``inline_runs``)."""
    cases: dict[str, Launch] = {}
    if runs_test(request, test_damaged_newest_commit_falls_back_to_the_previous_one):
        cases["damaged"] = functools.partial(damaged_run, request.getfixturevalue("fault_free"))
    if runs_test(request, test_run_elastic_restarts_workers_without_torchrun):
        cases["inline"] = inline_runs
    if runs_test(request, test_indivisible_world_size_keeps_per_rank_batches_and_scales_the_learning_rate):
        for name, flags in INDIVISIBLE.items():
            cases[f"indivisible-{name}"] = functools.partial(
                indivisible_run, request.getfixturevalue("fault_free"), flags
            )
    return launch_all(tmp_path_factory.mktemp("resumed"), cases)


@pytest.mark.timeout(2 * RESUMED_BUDGET)
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_newest_commit_falls_back_to_the_previous_one(
    resumed: dict[str, Ran], fault_free: dict[str, Path], damage: str
) -> None:
    """A first run stops after step 7 (commits 3 and 6); the newest commit is then damaged; the next
    run skips it with a warning, resumes from commit 3 and ends on the fault-free weights."""
    root, proc = launched(resumed, "damaged")
    out = root / damage
    newest = out / "commits" / "commit-00000006.pt"
    assert proc.returncode == 0, proc.stderr[-6000:]
    reason = "truncated: payload has" if damage == "truncated" else "refused by torch.load(weights_only=True)"
    assert f"skipping commit {newest}: {reason}" in proc.stderr, proc.stderr[-3000:]
    assert not (root / "pickle_ran").exists(), "the pickle payload ran"
    assert_recovered(out, fault_free["average"], resumed_from=3)


def test_restarts_exhausted_exit_non_zero_in_bounded_time(tmp_path: Path) -> None:
    """Launched alone, not with ``resumed``'s group: its bound is on its own wall time."""
    start = time.monotonic()
    proc = torchrun_proc(
        tmp_path / "doomed", "--kill-rank", "1", "--kill-step", "2", max_restarts=1,
        ELASTIC_RUN_KILL_EVERY_ATTEMPT="1",
    )  # fmt: skip
    assert proc.returncode != 0
    assert time.monotonic() - start < 100


@pytest.mark.timeout(2 * RESUMED_BUDGET)
def test_run_elastic_restarts_workers_without_torchrun(resumed: dict[str, Ran]) -> None:
    root, _ = launched(resumed, "inline")
    results = {name: json.loads((root / name / "results.json").read_text()) for name in INLINE}
    killed, clean = results["killed"], results["fault_free"]
    for rank in ("0", "1"):
        assert clean[rank]["attempt"] == 0 and clean[rank]["resumed_from"] is None
        assert (
            killed[rank]["attempt"] == 1 and killed[rank]["resumed_from"] == 3 and killed[rank]["step"] == 9
        )
        assert killed[rank]["weights"] == clean[rank]["weights"]


SCALE_STEPS = 24
SCALE_BUDGET = 200
"""Seconds for the two agents of a 2->1->2 run to finish; the background command that runs the
reductions gets 30 s more (its own Python's start), half the test's timeout."""
SCALE_BOUND = {"powersgd": 0.02, "adasum": 0.75}
"""How far the 2 -> 1 -> 2 run may end from the fault-free run at world size 2, as a fraction of how
far that run ends from the uncompressed average run (max abs weight difference). Average keeps the
global batch and the reduction, so its bound is 1e-6 absolute (measured: 0, bitwise). PowerSGD at
world size 1 compresses one gradient instead of averaging two compressed ones (measured 0.0033).
Adasum of one rank is the plain average of its gradients, so the 6 of 24 steps taken at world size 1
(``HOLD_FROM``) are averaging steps (measured 0.29; 0.50 when 9 steps were)."""


HOLD_FROM = 14
"""The run at world size 1 trains up to step 13 and then waits until the restarted node joins (its
agent stops the worker), whatever the time the node takes to start: steps 6-11 stay at world size 1
(the commit of step 12 is where world size 2 resumes)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def elastic_agent(out: Path, port: int, hosts_store: bool, *args: str) -> list[str]:
    """One torchrun agent (one "node", one worker) of a run that may have 1 or 2 nodes."""
    conf = f"is_host={int(hosts_store)},last_call_timeout=1,join_timeout=60,close_timeout=5"
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
            "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=scale", f"--rdzv-conf={conf}", "--monitor-interval=0.2",
            str(SCRIPTS / "elastic_run.py"), "--out", str(out), "--commit-every", str(COMMIT_EVERY),
            "--max-steps", str(SCALE_STEPS), "--step-sleep", "0.3", "--hold-alone-from", str(HOLD_FROM),
            *args]  # fmt: skip


def wait_for_step(out: Path, world: int, step: int, deadline: float) -> None:
    """Until some worker of a ``world``-rank incarnation has trained on step ``step`` or later."""
    while not any(e["world"] == world and e["step"] >= step for e in sample_log(out)):
        assert time.monotonic() < deadline, f"no step >= {step} at world size {world} in time"
        time.sleep(0.2)


def scale_run(out: Path, reduction: str) -> tuple[int, int]:
    """Two torchrun agents on one c10d rendezvous; one is killed (the run goes on at world size 1
    from the last commit), then started again (world size 2 from the next commit). The two
    remaining agents' exit codes."""
    out.mkdir(parents=True)
    port, args = free_port(), REDUCTIONS[reduction]
    # torch's shared rendezvous store loses the master address when a node leaves and joins again
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": CHILD_PATH}
    deadline = time.monotonic() + SCALE_BUDGET
    with spawned(elastic_agent(out, port, True, *args), out / "agent_a.log", **env) as agent_a:
        time.sleep(1.0)  # agent A hosts the rendezvous store
        with spawned(elastic_agent(out, port, False, *args), out / "agent_b.log", **env) as agent_b:
            wait_for_step(out, world=2, step=7, deadline=deadline)
            kill_tree(agent_b.pid)
        wait_for_step(out, world=1, step=HOLD_FROM - 1, deadline=deadline)
        with spawned(elastic_agent(out, port, False, *args), out / "agent_b2.log", **env) as agent_b2:
            return agent_a.wait(timeout=deadline - time.monotonic()), agent_b2.wait(timeout=30)


def scale_runs(root: Path) -> dict[str, tuple[str, Union[list[int], str]]]:
    """``scale_run`` of each reduction, all at once (the agents mostly wait: on the rendezvous, the
    restarts, the slowed steps), each within ``SCALE_BUDGET``; reduction -> its out folder and the
    agents' exit codes, or why the run stopped (that reduction's test fails). Runs in the background
    (tests/background.py)."""

    def run(reduction: str) -> tuple[str, Union[list[int], str]]:
        out = root / reduction
        try:
            return str(out), list(scale_run(out, reduction))
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            return str(out), f"{type(exc).__name__}: {exc}"

    return concurrently({r: functools.partial(run, r) for r in REDUCTIONS})


def scaling(out: Path) -> Command:
    """``scale_runs`` in a Python of its own, beside the session's other tests."""
    return python_call(scale_runs, out, SCALE_BUDGET + 30)


@pytest.fixture(scope="module")
def scaled(background_jobs: BackgroundJobs) -> dict[str, tuple[Path, Union[tuple[int, ...], str]]]:
    """``scale_runs``' results, read back: reduction -> (its out folder, the exit codes or why not)."""
    return {
        reduction: (Path(out), tuple(codes) if isinstance(codes, list) else codes)
        for reduction, (out, codes) in background_jobs.result(scaling).value().items()
    }


@pytest.mark.timeout(2 * (SCALE_BUDGET + 30))
@pytest.mark.background(make=scaling)
@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_world_size_2_to_1_to_2_keeps_the_trajectory(
    scaled: dict[str, tuple[Path, Union[tuple[int, ...], str]]], fault_free: dict[str, Path], reduction: str
) -> None:
    """``scale_run``: every step read its samples once, the same ones as the fault-free run at world
    size 2, and the run ends on its weights (average: bitwise) or within ``SCALE_BOUND`` of them."""
    reference_run, (out, codes) = fault_free[f"{reduction}_scale"], scaled[reduction]
    logs = "".join(p.read_text()[-4000:] for p in sorted(out.glob("agent_*.log")))
    assert codes == (0, 0), f"{codes}\n{logs}"
    log = sample_log(out)
    trajectory = final_trajectory(out)
    assert sorted(trajectory) == list(range(SCALE_STEPS))
    used = [s for step in trajectory.values() for s in step]
    assert len(used) == SCALE_STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample used twice"
    assert trajectory == final_trajectory(reference_run), "step s read the same samples on every world size"
    last = {e["step"]: e for e in sorted(log, key=lambda e: e["incarnation"])}
    worlds = [last[step]["world"] for step in range(SCALE_STEPS)]
    assert 1 in worlds and worlds[0] == worlds[-1] == 2, worlds
    weights, reference = torch.load(out / "rank0.pt"), torch.load(reference_run / "rank0.pt")
    if reduction == "average":
        assert_same_weights(weights, reference, atol=1e-6)
        return
    scale = max_abs_diff(reference, torch.load(fault_free["average_scale"] / "rank0.pt"))
    diff = max_abs_diff(weights, reference)
    print(f"{reduction}: worlds by step {worlds}; weights {diff:.3g} from fault-free ({diff / scale:.3g} x)")
    assert diff <= SCALE_BOUND[reduction] * scale


@pytest.mark.timeout(2 * RESUMED_BUDGET)
def test_indivisible_world_size_keeps_per_rank_batches_and_scales_the_learning_rate(
    resumed: dict[str, Ran],
) -> None:
    """Global batch 8 committed at world size 2, resumed on 3 ranks: each rank keeps 4 samples a
    step (12 per step, a warning says so), the learning rate is scaled by 12/8, every sample is still
    read at most once, and ``scale_lr=False`` leaves the rate to the user."""
    lrs = {}
    for name in INDIVISIBLE:
        out, proc = launched(resumed, f"indivisible-{name}")
        assert proc.returncode == 0, proc.stderr[-6000:]
        assert "global_batch=8 is not divisible by world_size=3" in proc.stderr
        facts = json.loads((out / "rank0.json").read_text())
        assert facts["resumed_from"] == 6 and facts["world_size"] == 3 and facts["global_step"] == 9
        lrs[name] = (facts["lr"], facts["lr_factor"])
        trajectory = final_trajectory(out)
        assert [len(trajectory[s]) for s in range(9)] == [8] * 6 + [12] * 3
        used = [s for step in trajectory.values() for s in step]
        assert len(set(used)) == len(used), "a sample used twice"
    assert lrs["scaled"][1] == 1.5 and lrs["unscaled"][1] == 1.0
    assert lrs["scaled"][0] == pytest.approx(1.5 * lrs["unscaled"][0], rel=1e-12)
