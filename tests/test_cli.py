"""The `lightning-dist` command: `env` reports, `demo` trains every strategy and prints the table."""

from __future__ import annotations

import importlib
import platform
import shutil

import lightning
import pytest
import torch
from helpers import child_env, run_script

from lightning_dist.cli import main

LAUNCHERS = ("mpirun", "horovodrun", "torchrun", "srun", "sbatch")


def parse_env(out: str) -> dict[str, str]:
    """`lightning-dist env` prints one line per item: its name, then its value."""
    fields = {}
    for line in out.splitlines():
        name, value = line.split(maxsplit=1)
        fields[name] = value
    return fields


def check_env(out: str, path: str | None) -> None:
    """The printed versions are the installed ones, and each launcher is where ``path`` finds it."""
    got = parse_env(out)
    assert got["python"] == platform.python_version()
    assert got["torch"] == f"{torch.__version__} (cuda available: {torch.cuda.is_available()})"
    assert got["lightning"] == lightning.__version__
    for backend in ("gloo", "nccl"):
        available = getattr(torch.distributed, f"is_{backend}_available")()
        assert got[backend] == ("available" if available else "not available")
    try:
        horovod = importlib.import_module("horovod")
    except ImportError:
        assert got["horovod"].startswith("not installed")
    else:
        assert got["horovod"] == horovod.__version__
    for tool in LAUNCHERS:
        assert got[tool] == (shutil.which(tool, path=path) or "not found"), tool
    assert got.keys() == {"python", "torch", "lightning", "gloo", "nccl", "horovod", *LAUNCHERS}


def test_env_prints_the_installed_versions_and_launchers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    check_env(capsys.readouterr().out, path=None)


@pytest.mark.slow
def test_env_console_script() -> None:
    out = run_script(["lightning-dist", "env"], timeout=60).stdout
    check_env(out, path=child_env()["PATH"])


@pytest.mark.slow
@pytest.mark.timeout(360)  # above the demo's budget
def test_demo_prints_one_row_per_strategy() -> None:
    from lightning_dist.workload.demo import demo_runs

    # 9 rows, one 2-process training each: about 65 s on 2 shared cores
    # --cap-mbit 0: no capped-link column (as root it would train every row again across 2 emulated
    # nodes, doubling the time; tests/test_bench_cluster.py covers that column's table)
    out = run_script(
        ["python", "-m", "lightning_dist.cli", "demo", "--steps", "4", "--cap-mbit", "0"], timeout=300
    ).stdout
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "strategy"
    rows = {line.split("|")[1].strip(): line for line in table[1:]}
    for run in demo_runs():
        assert run.label in rows, out
        assert "failed" not in rows[run.label]
    ours = rows["DDP()"].split("|")
    assert ours[2].strip().endswith("ms") and int(ours[3].strip().replace(",", "")) > 0
