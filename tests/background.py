"""Commands that mostly wait, started when the session starts and read by the tests that own them.

A test marked ``@pytest.mark.background(make=make)`` owns the command ``make(out)`` returns. The
commands are queued when collection is done (tests/conftest.py) and run one at a time, each in a
process session of its own, while the session's other tests run; the tests that own them run last and
read a result with ``background_jobs.result(make)`` (waiting for what is left of the command's budget).
Only commands of selected tests run, once each; whatever still runs when the session ends is killed.

This fills the machine's idle time: a launch that waits on a link cap, a pip download or a timeout
leaves a core free that the other tests then use.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from helpers import ROOT, child_env, kill_tree

TESTS = Path(__file__).resolve().parent


@dataclass
class Command:
    """What a background test runs: ``argv`` (in ``cwd``, with ``child_env(**env)``) within
    ``budget_s`` seconds of its start."""

    argv: list[str]
    budget_s: float
    cwd: Path = ROOT
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Result:
    """A finished command: its exit code (None: killed at its budget), output and folder."""

    returncode: Optional[int]
    stdout: str
    stderr: str
    out: Path
    seconds: float

    def ok(self) -> Result:
        """This result, once checked: the command exited with 0 (else an error with its output)."""
        if self.returncode != 0:
            raise AssertionError(
                f"exit {self.returncode} after {self.seconds:.0f} s\n{self.stdout[-4000:]}\n{self.stderr[-6000:]}"
            )
        return self

    def value(self) -> Any:
        """What a ``python_call`` function returned (its JSON); an error with the output if it failed."""
        return json.loads((self.ok().out / "result.json").read_text())


Maker = Callable[[Path], Command]


def python_call(fn: Callable[[Path], Any], out: Path, budget_s: float) -> Command:
    """A command that calls ``fn(out)`` (a module-level function of a test module) in a Python of
    its own and writes what it returns, as JSON, to ``out/result.json`` (``Result.value``)."""
    argv = [sys.executable, str(Path(__file__)), fn.__module__, fn.__qualname__, str(out)]
    return Command(argv, budget_s, env={"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])})


@dataclass
class _Running:
    command: Command
    out: Path
    proc: subprocess.Popen[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]
    started: float
    result: Optional[Result] = None


class BackgroundJobs:
    """The session's background commands, by the function that makes each; at most ``lanes`` run
    at once (the others wait their turn, in the order they were asked for)."""

    def __init__(self, lanes: int = 1) -> None:
        self.lanes = lanes
        self._root = Path(tempfile.mkdtemp(prefix="ld-background-"))
        self._waiting: list[Maker] = []
        self._jobs: dict[Maker, _Running] = {}

    def start(self, make: Maker) -> None:
        """Queue ``make``'s command (once); it starts when a lane is free (``pump``)."""
        if make not in self._jobs and make not in self._waiting:
            self._waiting.append(make)
        self.pump()

    def pump(self) -> None:
        """Start waiting commands while fewer than ``lanes`` run (called between tests)."""
        while self._waiting and sum(job.proc.poll() is None for job in self._jobs.values()) < self.lanes:
            self._launch(self._waiting.pop(0))

    def _launch(self, make: Maker) -> None:
        out = self._root / make.__name__
        out.mkdir()
        command = make(out)
        stdout, stderr = open(out / "stdout.log", "w+b"), open(out / "stderr.log", "w+b")  # noqa: SIM115
        proc = subprocess.Popen(
            command.argv,
            stdout=stdout,
            stderr=stderr,
            env=child_env(**command.env),
            cwd=command.cwd,
            start_new_session=True,
        )
        self._jobs[make] = _Running(command, out, proc, stdout, stderr, time.monotonic())

    def result(self, make: Maker) -> Result:
        """``make``'s command once it has ended (started now if it still waits); past its budget (from
        its start) it is killed and the result's ``returncode`` is None."""
        if make not in self._jobs:
            if make in self._waiting:
                self._waiting.remove(make)
            self._launch(make)
        job = self._jobs[make]
        if job.result is None:
            left = job.started + job.command.budget_s - time.monotonic()
            try:
                code: Optional[int] = job.proc.wait(timeout=max(left, 0.0))
            except subprocess.TimeoutExpired:
                code = None
            self._end(job)
            job.result = Result(
                code, _read(job.stdout), _read(job.stderr), job.out, time.monotonic() - job.started
            )
            self.pump()
        return job.result

    def close(self) -> None:
        """Kill every command still running, forget those waiting, and remove the folders."""
        self._waiting.clear()
        for job in self._jobs.values():
            self._end(job)
            job.stdout.close()
            job.stderr.close()
        shutil.rmtree(self._root, ignore_errors=True)

    @staticmethod
    def _end(job: _Running) -> None:
        """Kill the command if it still runs (with its descendants), and its session's stragglers."""
        if job.proc.poll() is None:
            kill_tree(job.proc.pid)  # also descendants in other sessions (torchrun's workers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.proc.pid, signal.SIGKILL)
        job.proc.wait()


def _read(stream: IO[bytes]) -> str:
    stream.seek(0)
    return stream.read().decode(errors="replace")


if __name__ == "__main__":  # python_call's child: module, function, out folder
    module, name, out = sys.argv[1:4]
    value = getattr(importlib.import_module(module), name)(Path(out))
    (Path(out) / "result.json").write_text(json.dumps(value))
