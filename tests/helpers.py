"""Shared helpers for tests that run scripts in child processes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def mpirun_ranks(np: int) -> tuple[str, ...]:
    """``mpirun`` of ``np`` ranks on this machine (root allowed, oversubscribed, not bound to cores),
    passing ``child_env``'s PYTHONPATH and OMP_NUM_THREADS on; the command to run follows."""
    return ("mpirun", "-np", str(np), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
            "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS")  # fmt: skip


MPIRUN_TWO_RANKS = mpirun_ranks(2)
K = TypeVar("K")
V = TypeVar("V")
TEST_TIMEOUT: float | None = None
"""The running test's pytest-timeout in seconds, set by tests/conftest.py (None: no timer armed)."""


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # no inherited rendezvous port: each launch gets its own (Lightning's launcher, torchrun
    # --standalone; under srun, Lightning derives one from the job id)
    env.pop("MASTER_PORT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # console scripts of this interpreter's environment (horovodrun, torchrun) come first
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_command(
    cmd: list[str], timeout: float, cwd: Path = ROOT, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session (in ``cwd``); on timeout or interruption kill the whole process
    group (Lightning's rank children, mpirun's ranks), so nothing outlives the test.

    ``timeout`` (seconds) must be below the running test's pytest-timeout, so that it is this
    budget, with the command's output, that stops a stuck command; a test that needs more gets
    ``@pytest.mark.timeout(N)``."""
    if TEST_TIMEOUT is not None and timeout >= TEST_TIMEOUT:
        raise ValueError(
            f"budget timeout={timeout}s for {' '.join(map(str, cmd))} is not below this test's "
            f"pytest timeout ({TEST_TIMEOUT}s): lower it, or mark the test @pytest.mark.timeout(N), N > {timeout}"
        )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(**env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        kill_tree(proc.pid)  # also descendants in other sessions (torchrun's workers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something outside the tree still holds the pipes
            out, err = "", "(output lost: the pipes stayed open after the kill)"
        raise AssertionError(
            f"{' '.join(cmd)} killed after {timeout}s\n{out[-3000:]}\n{err[-5000:]}"
        ) from exc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers, or everything on an interrupt
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (torchrun starts its workers in their own sessions, so
    ``killpg`` of the agent misses them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (children first found, then killed together)."""
    for p in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


@contextlib.contextmanager
def spawned(cmd: list[str], log: Path, **env: str) -> Any:
    """``Popen(cmd)`` in its own session, output to ``log``; on leaving, it and every descendant
    still alive is killed, so a failing test leaves no process behind."""
    with open(log, "a") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(**env), cwd=ROOT, start_new_session=True
        )
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.wait()


def concurrently(calls: dict[K, Callable[[], V]], at_once: int | None = None) -> dict[K, V]:
    """Each of ``calls`` in a thread of its own, all at once or ``at_once`` at a time, in order
    (launches that mostly wait: on a timeout, a sleep, a restart); their results by key, once all
    have returned (the first error re-raised)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, at_once or len(calls))) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
    return {key: future.result() for key, future in futures.items()}


def lanes_budget(launches: int, budget: float, at_once: int) -> float:
    """Seconds ``launches`` of at most ``budget`` seconds each take at worst, ``at_once`` at a time
    (``concurrently``): the last starts once the others' work is shared out, then runs alone."""
    return budget * ((launches - 1) / at_once + 1)


def runs_test(request: Any, test: Callable[..., Any]) -> bool:
    """Whether this session runs ``test`` (any of its cases), a test of the requesting module."""
    return any(
        getattr(item, "originalname", None) == test.__name__ and item.path == request.path
        for item in request.session.items
    )


def selected_cases(request: Any, test: Callable[..., Any], *params: str) -> list[tuple[Any, ...]]:
    """The values of ``params`` of each case of the parametrized ``test`` that this session runs (a
    module fixture then prepares only those), in collection order."""
    cases = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == test.__name__ and callspec is not None:
            case = tuple(callspec.params[name] for name in params)
            if case not in cases:
                cases.append(case)
    return cases


def run_script(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a command (``python`` prepended when it starts with a .py path); fail with its output."""
    if args[0] == "python":
        args = [sys.executable, *args[1:]]
    cmd = [sys.executable, *args] if args[0].endswith(".py") else args
    proc = run_command(cmd, timeout, **env)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def run_in_sequence(
    runs: list[list[str]], timeout: float, launcher: Sequence[str] = (sys.executable,), **env: str
) -> subprocess.CompletedProcess[str]:
    """One launch that runs ``runs`` one after another in the same processes, each a script of
    tests/scripts and its arguments (tests/scripts/in_sequence.py); fail with the output.
    ``launcher``: what comes before the script's path (python: Lightning's launcher starts the
    ranks; mpirun's command ending in python; torchrun's)."""
    return run_script([*launcher, str(SCRIPTS / "in_sequence.py"), json.dumps(runs)], timeout, **env)


def load_rank(out: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    weights = torch.load(out / f"rank{rank}.pt")
    info = json.loads((out / f"rank{rank}.json").read_text())
    return weights, info


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def bad_integers(name: str, minimum: int = 1, owner: str = "") -> list[tuple[dict[str, Any], str]]:
    """``(kwargs, message)`` rows for an integer option given one below ``minimum``, an integral
    float and a bool: each refused with the message naming the argument and the bound."""
    prefix = f"{owner}: " if owner else ""
    return [
        ({name: value}, f"{prefix}{name}={value!r} must be an integer >= {minimum}")
        for value in (minimum - 1, float(minimum + 1), True)
    ]
