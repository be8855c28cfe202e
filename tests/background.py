"""Commands that mostly wait, started when the session starts and read by the tests that own them.

A test marked ``@pytest.mark.background(make=make)`` owns the command ``make(out)`` returns. The command
starts as soon as collection is done (tests/conftest.py), in a process session of its own, and runs
while the session's other tests run; the test runs last and reads its result with
``background_jobs.result(make)`` (waiting for what is left of the command's budget). Only commands of
selected tests start, once each; whatever is still running when the session ends is killed.

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
    """The session's background commands, by the function that makes each."""

    def __init__(self) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="ld-background-"))
        self._jobs: dict[Maker, _Running] = {}

    def start(self, make: Maker) -> None:
        """Start ``make``'s command (once) in a folder of its own."""
        if make in self._jobs:
            return
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
        """``make``'s command once it has ended (started now if it was not); past its budget it is
        killed and the result's ``returncode`` is None."""
        self.start(make)
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
        return job.result

    def close(self) -> None:
        """Kill every command still running and remove the folders."""
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
