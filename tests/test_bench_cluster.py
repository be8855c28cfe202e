"""benchmarks/bench_cluster.py: argument parsing, summaries and the markdown table (no processes), the
demo's capped-link column formatting, and one tiny run across 2 emulated nodes (root only)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from background import BackgroundJobs, Command

from lightning_dist.cluster import netns

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cluster.py"
BUDGET = 200
"""Seconds for the tiny setting (about 75 s on 2 shared cores): at most half the test's timeout."""


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_cluster", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_cluster", module)
    spec.loader.exec_module(module)
    return module


bench = load_bench()


@pytest.mark.parametrize(
    ("text", "mbit"),
    [
        ("none", None),
        ("10gbit", 10_000.0),
        ("1Gbit", 1000.0),
        ("100mbit", 100.0),
        ("500kbit", 0.5),
        ("250", 250.0),
    ],
)
def test_caps_parse(text: str, mbit: float | None) -> None:
    assert bench.parse_cap(text) == mbit


@pytest.mark.parametrize("text", ["fast", "0mbit", "-5", "inf", "gbit"])
def test_bad_caps_say_what_is_accepted(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="accepted 'none'"):
        bench.parse_cap(text)


def test_defaults_cover_every_row_cap_and_model() -> None:
    a = bench.parse_args([])
    assert a.models == ["workload", "mlp"]
    assert a.caps == [None, 10_000.0, 1000.0, 100.0]
    assert len(a.rows) == 18 and a.rows == list(bench.ROWS)
    assert (a.rounds, a.steps, a.warmup, a.worker) == (3, 20, 3, None)
    compressors = {r.options["compressor"] for r in bench.ROWS.values() if "compressor" in r.options}
    assert compressors == {"fp16", "bf16", "int8", "powersgd", "topk", "sign", "demo"}
    assert bench.REFERENCE in bench.ROWS and not bench.ROWS[bench.REFERENCE].ours
    assert {k for k, r in bench.ROWS.items() if r.mpirun} == {
        "horovod", "horovod_adasum", "hvd_loop", "hvd_loop_fp16", "hvd_loop_adasum"
    }  # fmt: skip


def test_tiny_setting_parses() -> None:
    a = bench.parse_args(
        ["--steps", "3", "--rounds", "1", "--caps", "none", "100mbit", "--rows", "ddp", "torch_ddp", "ddp"]
    )
    assert (a.steps, a.rounds, a.caps, a.rows) == (3, 1, [None, 100.0], ["ddp", "torch_ddp"])


@pytest.mark.parametrize(
    "argv", [["--rows", "nope"], ["--models", "gpt"], ["--steps", "0"], ["--rounds", "0"], ["--caps", "x"]]
)
def test_bad_arguments_exit_with_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_summarize_pools_rounds_and_keeps_failures() -> None:
    runs = [
        {"step_seconds": [0.1, 0.3], "counted_bytes": 100, "wire_bytes": 110.0, "loss": 2.0},
        {"error": "exit 1"},
        {"step_seconds": [0.2], "counted_bytes": None, "wire_bytes": 130.0, "loss": 3.0},
    ]
    s = bench.summarize(runs)
    assert s["median_s"] == pytest.approx(0.2) and (s["p25_s"], s["p75_s"]) == pytest.approx((0.15, 0.25))
    assert s["round_medians_s"] == pytest.approx([0.2, 0.2])
    assert (s["counted_bytes"], s["wire_bytes"], s["loss"], s["rounds"], s["failed"]) == (
        100,
        120.0,
        2.5,
        2,
        1,
    )
    assert bench.summarize([{"error": "exit 3"}]) == {"error": "exit 3", "failed": 1}
    assert bench.link_limit_s(12.5e6, 100.0) == pytest.approx(1.0)
    assert bench.link_limit_s(12.5e6, None) is None


def test_plot_says_why_when_no_run_measured_a_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    failed = {"mlp": {bench.cap_label(1000.0): {"horovod": bench.summarize([{"error": "exit 1"}])}}}
    why = bench.plot(failed, ["mlp"], [1000.0], ["horovod"], tmp_path / "cluster.png")
    assert why == "no plot: no run measured a step time (every run failed or was skipped)"
    assert not (tmp_path / "cluster.png").exists()
    ok = {"mlp": {bench.cap_label(1000.0): {"horovod": bench.summarize([{"step_seconds": [0.2]}])}}}
    assert bench.plot(ok, ["mlp"], [1000.0], ["horovod"], tmp_path / "cluster.png") is None
    assert (tmp_path / "cluster.png").stat().st_size > 1000


class _Exited:
    """A process that has already exited with 0."""

    returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    poll = wait


class _FakeCluster:
    """What ``launch`` uses of an EmulatedCluster: records the mpirun command, starts nothing."""

    master_port = 0

    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def mpirun_args(self) -> list[str]:
        return ["--host", "n0,n1"]

    def popen(self, node: int, cmd: list[str], env: dict[str, str], **kwargs: object) -> _Exited:
        self.commands.append(cmd)
        return _Exited()


@pytest.mark.parametrize("row", ["horovod", "hvd_loop"])
def test_timeline_asks_every_mpirun_run_for_horovods_own_timeline(tmp_path: Path, row: str) -> None:
    a = bench.parse_args(["--rows", row, "--timeline", str(tmp_path)])
    cluster = _FakeCluster()
    trace = str(tmp_path / f"mlp_none_{row}_round1.json")
    res = bench.launch(cluster, bench.ROWS[row], "mlp", a, str(tmp_path / "r.json"), 29500, trace)
    assert "error" in res  # the fake ran nothing
    (cmd,) = cluster.commands
    assert cmd[0] == "mpirun" and f"HOROVOD_TIMELINE={tmp_path}/mlp_none_{row}_round1.horovod.json" in cmd
    assert cmd.index("-x") < cmd.index(sys.executable), "mpirun's options come before the program"
    assert ("--timeline-out" in cmd) == bench.ROWS[row].ours  # the pack's Timeline: pack rows only


def test_table_has_ratios_bytes_link_limit_and_reasons() -> None:
    def ok(median: float, counted: float | None, wire: float) -> dict[str, object]:
        return {"median_s": median, "p25_s": median * 0.9, "p75_s": median * 1.1, "counted_bytes": counted,
                "wire_bytes": wire, "loss": 2.5, "rounds": 1, "failed": 0}  # fmt: skip

    summary = {
        "mlp": {
            "none": {"torch_ddp": ok(0.05, None, 16.8e6), "ld_ddp": ok(0.1, 16.8e6, 17e6)},
            "100 Mbit/s": {
                "torch_ddp": ok(1.4, None, 17e6),
                "ld_ddp": {"error": "exit 1", "failed": 2},
                "horovod": {"skipped": "mpirun not found"},
            },
        }
    }
    text = bench.format_tables(summary, ["mlp"], [None, 100.0], ["torch_ddp", "ld_ddp", "horovod"])
    lines = text.splitlines()
    grid = [line for line in lines if line.startswith("| DDP() | ") and line.count("|") == 4]
    assert grid == ["| DDP() | 100.0 ms (2.00x) | failed |"]
    assert "| DDP() | none | 100.0 ms | 90.0-110.0 | 2.00x | 16.800 MB | 17.000 MB | - | 2.5000 |" in lines
    ref = bench.ROWS["torch_ddp"].label
    assert (
        f"| {ref} | 100 Mbit/s | 1400.0 ms | 1260.0-1540.0 | 1.00x | - | 17.000 MB | 1360.0 ms | 2.5000 |"
        in lines
    )
    assert "| DDP() | 100 Mbit/s | failed (2 run(s)) | | | | | | |" in lines
    assert "| Horovod() (mpirun) | 100 Mbit/s | mpirun not found | | | | | | |" in lines
    assert bench.MODELS["mlp"] in text


def test_demo_table_gets_a_capped_column() -> None:
    from lightning_dist.workload.demo import format_table

    rows: list[tuple[str, dict]] = [
        (
            "DDP()",
            {"median_step_s": 0.1, "bytes_sent_per_step": 1000, "final_val_loss": 4.5, "strategy": "ld_ddp"},
        ),
        ("Horovod() (mpirun)", {"skipped": "skipped: no horovod"}),
    ]
    plain = format_table(rows).splitlines()
    assert "100 Mbit" not in plain[0] and len(plain) == 4
    capped = format_table(rows, {"DDP()": {"median_step_s": 0.25}}, "100 Mbit x 2 nodes").splitlines()
    assert capped[0].rstrip().endswith("100 Mbit x 2 nodes |")
    assert capped[2].rstrip().endswith("250.0 ms |") and capped[3].rstrip().endswith("- |")
    assert len({len(line) for line in capped[:3]}) == 1, "columns line up"


def tiny_setting(out: Path) -> Command:
    """Both models, uncapped and at 100 Mbit/s, our DDP() and Lightning's: 8 runs, one after another."""
    argv = ["--steps", "3", "--rounds", "1", "--caps", "none", "100mbit", "--rows", "ddp", "torch_ddp",
            "--out", str(out)]  # fmt: skip
    return Command([sys.executable, str(BENCH), *argv], BUDGET)


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
@pytest.mark.skipif(netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason()))
@pytest.mark.background(make=tiny_setting)
def test_tiny_setting_runs_across_two_emulated_nodes(background_jobs: BackgroundJobs) -> None:
    run = background_jobs.result(tiny_setting).ok()
    assert "[8/8 " in run.stdout, "one progress line per run"
    data = json.loads((run.out / "cluster.json").read_text())
    for model in ("workload", "mlp"):
        free, capped = (data["summary"][model][c]["torch_ddp"] for c in ("none", "100 Mbit/s"))
        # the gradients cross the veth: at least the fp32 ring all-reduce's share per rank
        assert free["wire_bytes"] > 1.5e6 and capped["wire_bytes"] > 1.5e6
        assert capped["median_s"] >= 0.9 * bench.link_limit_s(capped["wire_bytes"], 100.0)
    mlp = data["summary"]["mlp"]["100 Mbit/s"]["torch_ddp"]
    assert mlp["wire_bytes"] > 16e6, "4.2M fp32 gradients: 16.8 MB sent per rank and step"
    text = (run.out / "cluster.md").read_text()
    assert "| Lightning DDPStrategy 'ddp' | 100 Mbit/s |" in text and "1.00x" in text
    assert (run.out / "cluster.png").stat().st_size > 10_000


def test_demo_says_why_the_capped_column_is_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_dist.workload import demo

    monkeypatch.setattr(netns, "unavailable_reason", lambda rate_limited=True: "EmulatedCluster needs root")
    assert demo.capped_column([("DDP()", {"median_step_s": 0.1})], 10, "/nonexistent", [], 100.0) is None
    assert capsys.readouterr().out == "[demo] capped-link column skipped: EmulatedCluster needs root\n"
    with pytest.raises(ValueError, match="cap_mbit=-1 must be >= 0"):
        demo.main(steps=1, cap_mbit=-1)


def test_replot_draws_the_highlighted_rows_with_the_machine_in_the_title(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    monkeypatch.syspath_prepend(str(Path(BENCH).parent))  # as when the benchmark runs as a script
    results = Path(BENCH).parent / "results"
    shutil.copy(results / "cluster.json", tmp_path / "cluster.json")
    drawn: dict[str, object] = {}
    original = bench.plot

    def spy(*args: object, **kwargs: object) -> object:
        drawn["machine"] = args[5] if len(args) > 5 else kwargs.get("machine")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(bench, "plot", spy)
    assert bench.replot(tmp_path) is None
    assert (tmp_path / "cluster.png").stat().st_size > 10_000
    assert "2 cores, CPU processes over Gloo" in str(drawn["machine"]) and "torch 2.13.0+cpu" in str(
        drawn["machine"]
    )
    assert bench.REFERENCE not in bench.HIGHLIGHT and {"ld_ddp", "ddp", "c_int8"} <= set(bench.HIGHLIGHT)


def test_low_comm_replot_reads_the_table(tmp_path: Path) -> None:
    import shutil

    spec = importlib.util.spec_from_file_location("bench_low_comm", Path(BENCH).parent / "bench_low_comm.py")
    assert spec is not None and spec.loader is not None
    low = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(BENCH).parent))
    spec.loader.exec_module(low)
    shutil.copy(Path(BENCH).parent / "results" / "low_comm.md", tmp_path / "low_comm.md")
    low.replot(tmp_path)
    assert (tmp_path / "low_comm.png").stat().st_size > 10_000
    from machine_info import plot_caption

    assert (
        plot_caption("machine: vm | Linux | AMD EPYC | 2 cores")
        == "AMD EPYC, 2 cores, CPU processes over Gloo"
    )
