"""The examples a user copies: `--help` lists every flag with its default, and the CPU path (2
processes) trains, with the pack's DDP() equal to Lightning's own "ddp" on the same run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import ROOT, run_script

EXAMPLES = ROOT / "examples"
BUDGET = 200
"""Seconds for one run of an example; a test of n runs is marked
`@pytest.mark.timeout((n + 1) * BUDGET)`: each budget at most half its timeout, all of them below it."""


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


@pytest.mark.slow
@pytest.mark.timeout(4 * BUDGET)
def test_quickstart_trains_on_two_cpu_processes_like_lightning_ddp(tmp_path: Path) -> None:
    got = {}
    for strategy in ("ddp", "ld_ddp", "ld_compressed_int8"):
        out = tmp_path / f"{strategy}.json"
        args = ["--strategy", strategy, "--max-epochs", "2", "--root-dir", str(tmp_path / strategy)]
        run_script([str(EXAMPLES / "quickstart.py"), *args, "--metrics-json", str(out)], timeout=BUDGET)
        got[strategy] = json.loads(out.read_text())
    assert got["ddp"]["world_size"] == got["ld_ddp"]["world_size"] == 2
    assert got["ld_ddp"]["val/loss"] == pytest.approx(got["ddp"]["val/loss"], abs=1e-6)
    assert got["ld_ddp"]["val/acc"] > 0.5, "10 classes: chance is 0.1"
    assert got["ld_compressed_int8"]["val/loss"] == pytest.approx(got["ddp"]["val/loss"], rel=0.05)
    assert 0.2 < got["ld_compressed_int8"]["comm/compression_ratio"] < 0.35, "int8: about a quarter of fp32"


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_quickstart_logs_commmonitor_to_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX", reason="pip install tensorboardX (the dev extra has it)")
    run_script([str(EXAMPLES / "quickstart.py"), "--max-epochs", "1", "--logger", "tensorboard",
                "--root-dir", str(tmp_path)], timeout=BUDGET)  # fmt: skip
    events = list(tmp_path.rglob("events.out.tfevents.*"))
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
@pytest.mark.timeout(3 * BUDGET)
def test_lightning_cli_takes_the_strategy_from_yaml_and_from_a_flag(tmp_path: Path) -> None:
    base = [str(EXAMPLES / "lightning_cli.py"), "fit", "--config", str(EXAMPLES / "lightning_cli.yaml")]
    got = {}
    for name, extra in {"yaml": [], "flag": ["--trainer.strategy", "ld_ddp"]}.items():
        logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir"]
        run_script(
            [*base, *extra, *logger, str(tmp_path / name), "--trainer.log_every_n_steps", "5"], timeout=BUDGET
        )
        got[name] = _csv_metrics(tmp_path / name)
    assert 0.2 < got["yaml"]["comm/compression_ratio"] < 0.35, "the YAML's ld_compressed_int8"
    assert got["flag"]["comm/compression_ratio"] == pytest.approx(1.0, abs=0.01), "--trainer.strategy ld_ddp"
    for metrics in got.values():
        assert metrics["val/acc"] > 0.5, "10 classes: chance is 0.1"


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_train_example_runs_the_embedded_workload_on_two_cpu_processes(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    run_script([str(EXAMPLES / "train.py"), "--max-steps", "6", "--json-out", str(out)], timeout=BUDGET)
    summary = json.loads(out.read_text())
    assert summary["run"]["strategy"] == "ld_ddp" and summary["result"]["world_size"] == 2
    assert summary["result"]["bytes_sent_per_step"] > 0
