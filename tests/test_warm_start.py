"""The warm-restart standby (``lightning_dist.launch.warm_start``) and its stand-in (``warm_worker.py``):
the worker forked by the standby gets the stand-in's arguments, environment, working directory and
stdout, and the stand-in ends as the worker ended (exit code, or the signal that killed it), which is
what torchrun watches; without a standby the stand-in runs the script cold. The FaultTolerant fault
runs (tests/test_fault_tolerant.py) restart their groups through it under torchrun."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import child_env

from lightning_dist.launch.warm_start import WORKER, script_imports
from lightning_dist.launch.warm_worker import SOCKET_ENV

SCRIPT = """\
import json, os, signal, sys
import collections.abc
out = {"argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
       "probe": os.environ.get("PROBE"), "main": __name__, "socket": os.environ.get("LD_WARM_SOCKET")}
print(json.dumps(out), flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[1]))
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return path


def _standby(tmp_path: Path, arg: str) -> tuple[int, dict, int]:
    """The standby (``--bare``) running the stand-in directly as its "torchrun", from another cwd."""
    import json

    script = _script(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "lightning_dist.launch.warm_start", "--bare", "--script", str(script),
               "--", sys.executable, "-u", str(WORKER), str(script), arg]  # fmt: skip
    proc = subprocess.Popen(
        command,
        env=child_env(PROBE="seen"),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=60)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"the worker printed nothing; stderr:\n{stderr[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), proc.pid


def test_script_imports_are_the_top_level_absolute_ones(tmp_path: Path) -> None:
    assert script_imports(str(_script(tmp_path))) == ["json", "os", "signal", "sys", "collections.abc"]
    assert script_imports(str(tmp_path / "missing.py")) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_a_standby_the_stand_in_runs_the_script_cold(tmp_path: Path) -> None:
    import json

    script = _script(tmp_path)
    env = {k: v for k, v in child_env(PROBE="seen").items() if k != SOCKET_ENV}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(script), "5"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 5, proc.stderr
    assert "starting the worker cold" in proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["probe"] == "seen"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_standby_forks_the_worker_with_the_stand_ins_request_and_relays_its_exit(tmp_path: Path) -> None:
    code, seen, standby = _standby(tmp_path, "3")
    assert code == 3  # worker -> stand-in -> standby
    assert seen["argv"] == [str(tmp_path / "worker.py"), "3"] and seen["main"] == "__main__"
    assert seen["cwd"] == str(tmp_path / "cwd") and seen["probe"] == "seen"
    assert seen["socket"] and seen["ppid"] == standby  # forked by the standby, not started by the stand-in
    assert not Path(seen["socket"]).exists(), "the standby left its socket behind"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_kills_its_stand_in_with_the_same_signal(tmp_path: Path) -> None:
    code, _, _ = _standby(tmp_path, "kill")
    assert code == -signal.SIGKILL  # the worker's signal -> the stand-in's -> the standby's
