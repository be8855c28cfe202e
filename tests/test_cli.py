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
DEMO_BUDGET = 300
"""Seconds for `lightning-dist demo` (9 two-process trainings, about 65 s on 2 shared cores), at most
half its test's timeout."""


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
@pytest.mark.timeout(2 * DEMO_BUDGET)
def test_demo_prints_one_row_per_strategy() -> None:
    from lightning_dist.workload.demo import demo_runs

    # 9 rows, one 2-process training each: about 65 s on 2 shared cores
    # --cap-mbit 0: no capped-link column (as root it would train every row again across 2 emulated
    # nodes, doubling the time; tests/test_bench_cluster.py covers that column's table)
    out = run_script(
        ["python", "-m", "lightning_dist.cli", "demo", "--steps", "4", "--cap-mbit", "0"], timeout=DEMO_BUDGET
    ).stdout
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "strategy"
    rows = {line.split("|")[1].strip(): line for line in table[1:]}
    for run in demo_runs():
        assert run.label in rows, out
        assert "failed" not in rows[run.label]
    ours = rows["DDP()"].split("|")
    assert ours[2].strip().endswith("ms") and int(ours[3].strip().replace(",", "")) > 0
    # one progress line per trained row: its elapsed time, the count and the time left
    progress = [line for line in out.splitlines() if line.startswith("[demo] ") and " s (" in line]
    trained = [r for r in demo_runs() if "skipped" not in rows[r.label]]
    assert len(progress) == len(trained) > 0, out
    assert progress[0].endswith(f"(1/{len(trained)}; about " + progress[0].rsplit("about ", 1)[-1])
    assert progress[-1].endswith(f"({len(trained)}/{len(trained)}; all done)")


def test_demo_progress_line_estimates_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist.workload import demo

    progress = demo.Progress(3)
    clock = iter([0.0, 10.0, 10.0, 30.0])  # start, finish, start, finish
    monkeypatch.setattr(demo.time, "monotonic", lambda: next(clock))
    progress.start()
    first = progress.finish("DDP()")
    progress.start()
    second = progress.finish("Compressed", "FAILED")
    assert first == "[demo] DDP(): done in 10.0 s (1/3; about 20 s left)"
    assert second == "[demo] Compressed: FAILED in 20.0 s (2/3; about 15 s left)"


def test_install_horovod_is_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["install-horovod", "--dry-run"])
    out = capsys.readouterr()
    assert code in (0, 2), out  # 2: a build tool is missing here, and the plan says which
    assert "HOROVOD_WITH_PYTORCH=1" in out.out
    with pytest.raises(SystemExit):
        main(["install-horovod", "--no-such-flag"])
