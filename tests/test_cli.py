"""The `lightning-dist` command: `env` reports, `demo` trains every strategy and prints the table."""

from __future__ import annotations

import importlib
import json
import math
import platform
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import lightning
import pytest
import torch
from background import BackgroundJobs, Command
from helpers import child_env, run_script

import lightning_dist
from lightning_dist.cli import main
from lightning_dist.workload import WorkloadConfig

LAUNCHERS = ("mpirun", "horovodrun", "torchrun", "srun", "sbatch")
DEMO_BUDGET = 300
"""Seconds for `lightning-dist demo` on the tiny workload (9 two-process trainings in two launches:
Lightning's 7 rows, then mpirun's 2; about 60 s on 2 shared cores), at most half its test's timeout."""
TINY_WORKLOAD = {k: v for k, v in asdict(WorkloadConfig.tiny()).items() if k != "seed"}
"""WorkloadConfig.tiny()'s sizes (not its seed: the run's), passed to every row's training with
`--workload`: the demo's own path with a few-second model (tests/test_examples.py trains the
default size)."""
DEMO_LOSS_BOUND = {
    "DDP(reduce_op='adasum')": 0.05,
    "Compressed('fp16')": 0.02,
    "Compressed('int8')": 0.02,
    "Compressed('powersgd', rank=4)": 0.15,
    "Compressed('topk', ratio=0.01)": 0.6,
    "Horovod() (mpirun)": 0.8,
    "HorovodAdasum() (mpirun)": 0.3,
}
"""How far each row's final validation loss may end from DDP()'s after 4 steps of the tiny workload
(measured: 0.009, 0.000, 0.006, 0.043, 0.43, 0.50, 0.08): topk has barely started (1% of the
gradient a step), Horovod() averages with the learning rate scaled by the world size (2)."""


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
    assert got["lightning-dist"] == lightning_dist.__version__
    assert "lightning 2.6.x" in got["tested"] and "torch 2.11.x, 2.13.x" in got["tested"]
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
    assert got.keys() == {
        "lightning-dist",
        "tested",
        "python",
        "torch",
        "lightning",
        "gloo",
        "nccl",
        "horovod",
        *LAUNCHERS,
    }


def test_env_prints_the_installed_versions_and_launchers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    check_env(capsys.readouterr().out, path=None)


@pytest.mark.slow
def test_env_console_script() -> None:
    out = run_script(["lightning-dist", "env"], timeout=60).stdout
    check_env(out, path=child_env()["PATH"])


def demo_table(out: str) -> dict[str, list[str]]:
    """The demo's table: label -> its cells (median step, bytes sent/step, final val loss)."""
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in table[0].split("|")[1:-1]] == [
        "strategy", "median step", "bytes sent/step", "final val loss"
    ], out  # fmt: skip
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table[1:]]
    return {row[0]: row[1:] for row in rows}


def tiny_demo(out: Path) -> Command:
    """``lightning-dist demo`` on the tiny workload, 4 steps a row. ``--cap-mbit 0``: no capped-link
    column (as root it would train every row again across 2 emulated nodes, doubling the time;
    tests/test_bench_cluster.py covers that column's table)."""
    argv = [sys.executable, "-m", "lightning_dist.cli", "demo", "--steps", "4", "--cap-mbit", "0",
            "--workload", json.dumps(TINY_WORKLOAD)]  # fmt: skip
    return Command(argv, DEMO_BUDGET)


@pytest.mark.slow
@pytest.mark.timeout(2 * DEMO_BUDGET)
@pytest.mark.background(make=tiny_demo)
def test_demo_prints_one_row_per_strategy(background_jobs: BackgroundJobs) -> None:
    """Every row trains, and each is held to DDP()'s row: DDP() ends on the loss of Lightning's own
    DDPStrategy, the compressed rows send their share of its bytes, and every loss ends within its
    bound of DDP()'s."""
    from lightning_dist.workload.demo import demo_runs

    out = background_jobs.result(tiny_demo).ok().stdout
    rows = demo_table(out)
    for run in demo_runs():
        assert run.label in rows, out
        assert "failed" not in " ".join(rows[run.label]), out
    trained = {label: cells for label, cells in rows.items() if "skipped" not in " ".join(cells)}
    step, sent, _ = trained["DDP()"]
    assert step.endswith("ms") and int(sent.replace(",", "")) > 0
    loss = {label: float(cells[2]) for label, cells in trained.items()}
    reference = "Lightning DDPStrategy (reference)"
    assert abs(loss["DDP()"] - loss[reference]) <= 2e-4, "DDP() is Lightning's DDP (4 decimals printed)"
    assert loss["DDP()"] < math.log(256), "4 steps lower the loss below the untrained ln(256)"
    for label, bound in DEMO_LOSS_BOUND.items():
        if label in loss:
            assert abs(loss[label] - loss["DDP()"]) <= bound, (label, loss)
    sent_bytes = {label: int(c[1].replace(",", "")) for label, c in trained.items() if label != reference}
    ratio = {label: b / sent_bytes["DDP()"] for label, b in sent_bytes.items()}
    assert abs(ratio["Compressed('fp16')"] - 0.5) < 0.01, ratio
    assert 0.25 <= ratio["Compressed('int8')"] < 0.26, ratio
    assert ratio["Compressed('powersgd', rank=4)"] < 0.2 and ratio["Compressed('topk', ratio=0.01)"] < 0.05, (
        ratio
    )
    for label in ("DDP(reduce_op='adasum')", "Horovod() (mpirun)", "HorovodAdasum() (mpirun)"):
        assert label not in ratio or 1.0 <= ratio[label] < 1.01, (label, ratio)
    # one progress line per trained row: its elapsed time, the count and the time left
    progress = [line for line in out.splitlines() if line.startswith("[demo] ") and " s (" in line]
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


def test_an_unknown_ld_name_points_to_the_strategies_command() -> None:
    """The pack's trainer (examples/train.py, the demo, benchmarks) names the closest ld_ names and
    ``lightning-dist strategies`` for an ld_ name that is not registered; Lightning's own names and
    the registered ones pass. (``Trainer(strategy="ld_...")`` itself raises Lightning's message: it
    tests a list of the registry's keys and raises a fixed text, with no hook before it.)"""
    from lightning_dist.workload.train import build_strategy

    with pytest.raises(
        ValueError, match=r"strategy='ld_compresed_int8'.*did you mean 'ld_compressed_int8'"
    ) as err:
        build_strategy("ld_compresed_int8")
    assert "`lightning-dist strategies`" in str(err.value) and "'compressed_int8'" not in str(err.value)
    with pytest.raises(ValueError, match=r"registers; `lightning-dist strategies` lists every ld_ name"):
        build_strategy("ld_nothing_like_this_at_all")
    assert build_strategy("ld_compressed_int8") == "ld_compressed_int8"
    assert build_strategy("LD_DDP") == "LD_DDP"  # Lightning lowercases the names it looks up
    assert build_strategy("ddp") == "ddp"
