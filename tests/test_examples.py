"""The examples a user copies: `--help` lists every flag with its default, and the CPU path (2
processes) trains, with the pack's DDP() equal to Lightning's own "ddp" on the same run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from background import BackgroundJobs, Command
from helpers import ROOT, SCRIPTS

EXAMPLES = ROOT / "examples"
BUDGET = 300
"""Seconds for ``example_runs``' launch (about 15 s a run on 2 shared cores); each test that reads
it is marked `@pytest.mark.timeout(2 * BUDGET)`, so the budget is at most half its timeout."""
QUICKSTART = {
    strategy: ["--strategy", strategy, "--max-epochs", "2"]
    for strategy in ("ddp", "ld_ddp", "ld_compressed_int8")
}
CLI_BASE = ["fit", "--config", str(EXAMPLES / "lightning_cli.yaml")]
CLI = {"yaml": [], "flag": ["--trainer.strategy", "ld_ddp"]}
"""lightning_cli.py runs: the YAML's strategy, and one from a flag."""


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_help_lists_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    quickstart = load("quickstart")
    with pytest.raises(SystemExit):
        quickstart.parse_args(["--help"])
    text = capsys.readouterr().out
    flags = [a for a in quickstart.parse_args([]).__dict__]
    for flag in flags:
        option = "--" + flag.replace("_", "-")
        assert option in text, option
    assert text.count("(default:") >= len(flags), text


def test_quickstart_defaults_fit_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    quickstart = load("quickstart")
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "HOROVOD_RANK", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    args = quickstart.parse_args([])
    assert (args.accelerator, args.devices, args.strategy) == ("auto", "auto", "ld_ddp")
    assert quickstart.launched_devices() is None, "no launcher: Lightning starts the processes"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert quickstart.launched_devices() == (4, 2), "torchrun's processes per node and node count"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert quickstart.launched_devices() == (1, 1), "mpirun: one device per process"


def example_runs(root: Path) -> Command:
    """The examples' CPU runs, one after another in one 2-process launch (tests/scripts/in_sequence.py
    runs each example's ``main`` with its command line): quickstart.py with each of ``QUICKSTART``
    (``<strategy>.json``), lightning_cli.py with each of ``CLI`` (``<name>/``) and train.py
    (``summary.json``)."""
    quickstart, cli = str(EXAMPLES / "quickstart.py"), str(EXAMPLES / "lightning_cli.py")
    sequence = [
        [quickstart, *args, "--root-dir", str(root / name), "--metrics-json", str(root / f"{name}.json")]
        for name, args in QUICKSTART.items()
    ]
    logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir"]
    sequence += [[cli, *CLI_BASE, *extra, *logger, str(root / name), "--trainer.log_every_n_steps", "5"]
                 for name, extra in CLI.items()]  # fmt: skip
    sequence.append(
        [str(EXAMPLES / "train.py"), "--max-steps", "6", "--json-out", str(root / "summary.json")]
    )
    return Command([sys.executable, str(SCRIPTS / "in_sequence.py"), json.dumps(sequence)], BUDGET)


def tensorboard_run(root: Path) -> Command:
    """The example as a user runs it: `python examples/quickstart.py` (the other runs call its main)."""
    argv = [sys.executable, str(EXAMPLES / "quickstart.py"), "--max-epochs", "1", "--logger", "tensorboard",
            "--root-dir", str(root)]  # fmt: skip
    return Command(argv, BUDGET)


@pytest.fixture(scope="module")
def runs(background_jobs: BackgroundJobs) -> Path:
    """``example_runs``' folder, once it has run."""
    return background_jobs.result(example_runs).ok().out


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.background(make=example_runs)
def test_quickstart_trains_on_two_cpu_processes_like_lightning_ddp(runs: Path) -> None:
    got = {strategy: json.loads((runs / f"{strategy}.json").read_text()) for strategy in QUICKSTART}
    assert got["ddp"]["world_size"] == got["ld_ddp"]["world_size"] == 2
    assert got["ld_ddp"]["val/loss"] == pytest.approx(got["ddp"]["val/loss"], abs=1e-6)
    assert got["ld_ddp"]["val/acc"] > 0.5, "10 classes: chance is 0.1"
    assert got["ld_compressed_int8"]["val/loss"] == pytest.approx(got["ddp"]["val/loss"], rel=0.05)
    assert 0.2 < got["ld_compressed_int8"]["comm/compression_ratio"] < 0.35, "int8: about a quarter of fp32"


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.background(make=tensorboard_run)
def test_quickstart_logs_commmonitor_to_tensorboard(background_jobs: BackgroundJobs) -> None:
    """``tensorboard_run`` writes TensorBoard events with CommMonitor's metrics."""
    pytest.importorskip("tensorboardX", reason="pip install tensorboardX (the dev extra has it)")
    events = list(background_jobs.result(tensorboard_run).ok().out.rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    assert any(b"comm/bytes_sent" in e.read_bytes() for e in events)


def test_train_example_help_lists_every_flag_and_defaults_to_the_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_dist.workload import train

    parser = train.build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"--{action.dest} has no help"
    assert "(default: auto)" in parser.format_help()
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    run, _ = train.parse_args([])
    assert (run.accelerator, run.devices) == ("cpu", 2), "no GPU: 2 CPU processes"
    assert train.parse_args(["--devices", "8"])[0].accelerator == "cpu"
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: True)
    run, _ = train.parse_args(["--devices", "8"])
    assert (run.accelerator, run.devices) == ("gpu", 8), (
        "--devices 8 on a GPU box: 8 GPUs, not 8 CPU processes"
    )
    assert train.parse_args([])[0].devices == -1, "every GPU"


def _csv_metrics(root: Path) -> dict[str, float]:
    """The last value of each metric in the CSVLogger file under ``root``."""
    import csv

    (path,) = root.rglob("metrics.csv")
    last: dict[str, float] = {}
    for row in csv.DictReader(path.open()):
        last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.background(make=example_runs)
def test_lightning_cli_takes_the_strategy_from_yaml_and_from_a_flag(runs: Path) -> None:
    got = {name: _csv_metrics(runs / name) for name in CLI}
    assert 0.2 < got["yaml"]["comm/compression_ratio"] < 0.35, "the YAML's ld_compressed_int8"
    assert got["flag"]["comm/compression_ratio"] == pytest.approx(1.0, abs=0.01), "--trainer.strategy ld_ddp"
    for metrics in got.values():
        assert metrics["val/acc"] > 0.5, "10 classes: chance is 0.1"


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.background(make=example_runs)
def test_train_example_runs_the_embedded_workload_on_two_cpu_processes(runs: Path) -> None:
    summary = json.loads((runs / "summary.json").read_text())
    assert summary["run"]["strategy"] == "ld_ddp" and summary["result"]["world_size"] == 2
    assert summary["result"]["bytes_sent_per_step"] > 0
