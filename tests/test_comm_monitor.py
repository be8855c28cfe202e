"""CommMonitor: every metric's formula on fake trainers, modules, clocks and counters (fast); a real
1-process fit with gradient accumulation (fast, in this process); 2-process fits with DDP() and
Compressed("fp16") logging through a CSVLogger (slow)."""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from helpers import MPIRUN_TWO_RANKS, SCRIPTS, run_in_sequence
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_dist.callbacks import CommMonitor
from lightning_dist.callbacks import monitor as monitor_module
from lightning_dist.compression.wire import ring_all_reduce_bytes
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

NUMEL = 1000  # trainable elements of the fake module (plus 7 frozen ones)


class FakeModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NUMEL))
        self.frozen = nn.Parameter(torch.zeros(7), requires_grad=False)
        self.logged: list[tuple[str, float, dict[str, Any]]] = []

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged.append((name, value, kwargs))


class FakeCounters:
    """What the strategy's ``communicator.stats`` holds: totals the test advances by hand."""

    def __init__(self) -> None:
        self.totals = {
            "bytes_sent": 0.0,
            "bytes_received": 0.0,
            "seconds": 0.0,
            "calls": 0.0,
            "busy_seconds": 0.0,
        }

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


class Rig:
    """A CommMonitor driven by hand: a fake trainer, module, clock and counters."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, world_size: int, **kwargs: Any) -> None:
        self.counters = FakeCounters()
        self.clock = 100.0
        monkeypatch.setattr(monitor_module, "perf_counter", lambda: self.clock)
        strategy = SimpleNamespace(communicator=SimpleNamespace(stats=self.counters))
        self.trainer: Any = SimpleNamespace(global_step=0, world_size=world_size, strategy=strategy)
        self.module: Any = FakeModule()
        self.monitor = CommMonitor(**kwargs)
        self.monitor.on_train_start(self.trainer, self.module)

    def batch(
        self,
        batch: Any,
        seconds: float,
        sent: int,
        received: int,
        comm: float,
        steps: bool = True,
        gap: float = 5.0,
    ) -> None:
        """One training batch taking ``seconds``, moving these bytes; ``steps``: the optimizer steps."""
        self.clock += gap  # time between batches (data loading) is not in the step
        self.counters.totals["bytes_sent"] += 999  # and neither are collectives between batches
        self.monitor.on_train_batch_start(self.trainer, self.module, batch, 0)
        self.clock += seconds
        self.counters.totals["bytes_sent"] += sent
        self.counters.totals["bytes_received"] += received
        self.counters.totals["seconds"] += 2 * comm  # summed over overlapping collectives: not what is logged
        self.counters.totals["busy_seconds"] += comm
        if steps:
            self.trainer.global_step += 1
        self.monitor.on_train_batch_end(self.trainer, self.module, torch.tensor(1.5), batch, 0)

    def logged(self) -> dict[str, float]:
        return {name: value for name, value, _ in self.module.logged}


def tokens(batch: int = 8, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (batch, seq))
    return x, x


def test_every_metric_matches_its_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    w = 4
    rig = Rig(monkeypatch, world_size=w, single_process_samples_per_s=50.0)
    reference = ring_all_reduce_bytes(4 * NUMEL, w)  # 2 * 3 * 4000 // 4 = 6000
    assert reference == 6000
    rig.batch(tokens(8, 16), seconds=0.5, sent=4500, received=4000, comm=0.125)
    got = rig.logged()
    sps = 8 * w / 0.5
    expected = {
        "perf/step_seconds": 0.5,
        "comm/bytes_sent": 4500.0,
        "comm/bytes_received": 4000.0,
        "comm/seconds": 0.125,
        "comm/share": 0.125 / 0.5,
        "comm/compression_ratio": 4500 / 6000,
        "perf/samples_per_s": sps,
        "perf/tokens_per_s": 8 * 16 * w / 0.5,
        "perf/scaling_efficiency": sps / (w * 50.0),
    }
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    assert rig.monitor.history == [got]
    assert rig.monitor.losses == [1.5]
    # every key on the step only, rank-local; the default progress-bar keys
    for name, _, kwargs in rig.module.logged:
        assert kwargs["on_step"] is True and kwargs["on_epoch"] is False and kwargs["sync_dist"] is False
        assert kwargs["prog_bar"] == (name in ("perf/samples_per_s", "comm/share"))


def test_gradient_accumulation_adds_the_micro_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    w = 2
    rig = Rig(monkeypatch, world_size=w)
    rig.batch(tokens(8, 16), seconds=0.25, sent=10, received=12, comm=0.0625, steps=False)
    assert rig.module.logged == [] and rig.monitor.history == []  # no step yet: nothing logged
    rig.batch(tokens(8, 16), seconds=0.75, sent=8000, received=8002, comm=0.25, steps=True)
    got = rig.logged()
    assert got["perf/step_seconds"] == pytest.approx(1.0)  # 0.25 + 0.75, not the 5 s gap
    assert got["comm/bytes_sent"] == 8010  # not the 999 bytes sent between the batches
    assert got["comm/bytes_received"] == 8014
    assert got["comm/seconds"] == pytest.approx(0.3125)
    assert got["comm/share"] == pytest.approx(0.3125)
    assert got["comm/compression_ratio"] == pytest.approx(8010 / ring_all_reduce_bytes(4 * NUMEL, w))
    assert got["perf/samples_per_s"] == pytest.approx(16 * w / 1.0)
    assert got["perf/tokens_per_s"] == pytest.approx(16 * 16 * w / 1.0)
    assert "perf/scaling_efficiency" not in got  # no single-process throughput given
    assert rig.monitor.samples == [16] and rig.monitor.bytes_sent == [8010]
    assert len(rig.monitor.losses) == 2  # one per batch
    # the next step starts from zero
    rig.module.logged.clear()
    rig.batch(tokens(8, 16), seconds=0.5, sent=4000, received=4000, comm=0.0, steps=True)
    assert rig.logged()["comm/bytes_sent"] == 4000
    assert rig.logged()["perf/step_seconds"] == pytest.approx(0.5)


def test_compression_ratio_of_half_the_ring_bytes_is_one_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Compressed('fp16') sends: a ring all-reduce of 2-byte gradients."""
    rig = Rig(monkeypatch, world_size=2)
    fp16 = ring_all_reduce_bytes(2 * NUMEL, 2)
    rig.batch(tokens(), seconds=1.0, sent=fp16, received=fp16, comm=0.1)
    assert rig.logged()["comm/compression_ratio"] == pytest.approx(0.5)


def test_batch_size_tokens_and_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    # features, not token ids: samples from dim 0 of the first tensor, no tokens
    rig = Rig(monkeypatch, world_size=2)
    rig.batch({"x": torch.randn(6, 3), "y": torch.zeros(6)}, seconds=2.0, sent=0, received=0, comm=0.0)
    got = rig.logged()
    assert got["perf/samples_per_s"] == pytest.approx(6 * 2 / 2.0)
    assert "perf/tokens_per_s" not in got
    # batch_size= and tokens_per_sample= given
    rig = Rig(monkeypatch, world_size=3, batch_size=5, tokens_per_sample=100)
    rig.batch([torch.randn(6, 3)], seconds=2.0, sent=0, received=0, comm=0.0)
    got = rig.logged()
    assert got["perf/samples_per_s"] == pytest.approx(5 * 3 / 2.0)
    assert got["perf/tokens_per_s"] == pytest.approx(500 * 3 / 2.0)
    # no tensor at all: no throughput
    rig = Rig(monkeypatch, world_size=2)
    rig.batch(["text"], seconds=1.0, sent=0, received=0, comm=0.0)
    assert "perf/samples_per_s" not in rig.logged()


def test_world_size_one_has_no_compression_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, world_size=1, single_process_samples_per_s=16.0)
    rig.batch(tokens(8, 4), seconds=0.5, sent=0, received=0, comm=0.0)
    got = rig.logged()
    assert "comm/compression_ratio" not in got
    assert got["comm/share"] == 0.0
    assert got["perf/scaling_efficiency"] == pytest.approx(1.0)  # 16 samples/s against 16


def test_options_prog_bar_sync_dist_and_log_false(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, world_size=2, prog_bar=["comm/bytes_sent"], sync_dist=True)
    rig.batch(tokens(), seconds=1.0, sent=1, received=1, comm=0.0)
    flags = {name: kw for name, _, kw in rig.module.logged}
    assert [n for n, kw in flags.items() if kw["prog_bar"]] == ["comm/bytes_sent"]
    assert all(kw["sync_dist"] for kw in flags.values())
    rig = Rig(monkeypatch, world_size=2, log=False)
    rig.batch(tokens(), seconds=1.0, sent=1, received=1, comm=0.0)
    assert rig.module.logged == [] and len(rig.monitor.history) == 1
    with pytest.raises(ValueError, match="unknown keys"):
        CommMonitor(prog_bar=["samples_per_s"])
    with pytest.raises(ValueError, match="single_process_samples_per_s"):
        CommMonitor(single_process_samples_per_s=0)


def test_summary_medians_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(monkeypatch, world_size=2, warmup=1, single_process_samples_per_s=1.0)
    for seconds, sent in ((9.0, 1), (1.0, 100), (2.0, 300), (4.0, 200)):
        rig.batch(tokens(4, 8), seconds=seconds, sent=sent, received=sent + 1, comm=seconds / 4)
    s = rig.monitor.summary()
    ref = ring_all_reduce_bytes(4 * NUMEL, 2)
    assert s["steps"] == 4
    assert s["median_step_s"] == 2.0
    assert s["bytes_sent_per_step"] == 200
    assert s["bytes_received_per_step"] == 201
    assert s["comm_s_per_step"] == pytest.approx(0.5)
    assert s["comm_share"] == pytest.approx(0.25)
    assert s["compression_ratio"] == pytest.approx(200 / ref)
    assert s["samples_per_s"] == pytest.approx(8 / 2.0)
    assert s["tokens_per_s"] == pytest.approx(64 / 2.0)
    assert s["scaling_efficiency"] == pytest.approx(8 / 2.0 / 2)
    empty = CommMonitor().summary()
    assert empty["steps"] == 0 and math.isnan(empty["median_step_s"]) and empty["bytes_sent_per_step"] == 0


def test_a_strategy_it_cannot_measure_is_named_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a strategy without the pack's communicator (Lightning's "ddp") at world size > 1 the
    comm/* values read 0: one warning says so, naming the strategy and what CommMonitor measures.
    The pack's strategies, and one process (nothing to send), get none."""
    import warnings

    from lightning.pytorch.strategies import DDPStrategy

    monkeypatch.setattr(monitor_module, "perf_counter", lambda: 0.0)
    module: Any = FakeModule()
    lightning_ddp: Any = SimpleNamespace(global_step=0, world_size=2, strategy=DDPStrategy())
    monitor = CommMonitor()
    with pytest.warns(UserWarning) as caught:
        for _ in range(2):  # a second fit: no second warning
            monitor.on_train_start(lightning_ddp, module)
    (warning,) = [w for w in caught if "CommMonitor" in str(w.message)]
    message = str(warning.message)
    for part in ("DDPStrategy", "comm/bytes_sent", "comm/share", "lightning-dist strategies", "ld_ddp"):
        assert part in message, (part, message)
    counted = SimpleNamespace(communicator=SimpleNamespace(stats=FakeCounters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CommMonitor().on_train_start(SimpleNamespace(global_step=0, world_size=2, strategy=counted), module)
        alone = SimpleNamespace(global_step=0, world_size=1, strategy=SimpleNamespace())
        CommMonitor().on_train_start(alone, module)


def test_real_fit_one_process_with_accumulation(tmp_path: Path) -> None:
    """Lightning's own hooks: one logged row per optimizer step, micro-batches added up, the
    progress-bar keys in ``trainer.progress_bar_metrics``."""
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    config = WorkloadConfig.tiny(seed=7)
    monitor = CommMonitor(warmup=0, single_process_samples_per_s=10.0)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path, name="", version=""),
        log_every_n_steps=1,
        callbacks=[monitor],
    )
    trainer.fit(TinyCausalLM(config))
    assert len(monitor.history) == 3 and len(monitor.losses) == 6
    assert monitor.samples == [2 * config.batch_size] * 3
    assert {"perf/samples_per_s", "comm/share"} <= set(trainer.progress_bar_metrics)
    with open(tmp_path / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("perf/samples_per_s")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    for row, h in zip(rows, monitor.history):
        sps = 2 * config.batch_size / h["perf/step_seconds"]
        assert float(row["perf/samples_per_s"]) == pytest.approx(sps, rel=1e-5)
        assert float(row["perf/tokens_per_s"]) == pytest.approx(sps * config.seq_len, rel=1e-5)
        assert float(row["perf/scaling_efficiency"]) == pytest.approx(sps / 10.0, rel=1e-5)
        assert float(row["comm/bytes_sent"]) == 0.0 and "comm/compression_ratio" not in h


def test_log_false_logs_nothing_in_a_real_fit() -> None:
    """``log=False`` holds through Lightning's fit (which sets every callback's ``log`` attribute
    to the module's ``log`` method): counters kept, nothing logged."""
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    monitor = CommMonitor(warmup=0, log=False)
    trainer = quiet_trainer(
        accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, callbacks=[monitor]
    )
    trainer.fit(TinyCausalLM(WorkloadConfig.tiny(seed=7)))
    assert len(monitor.history) == 2
    logged = set(trainer.callback_metrics) | set(trainer.progress_bar_metrics)
    assert not {k for k in logged if k.startswith(("perf/", "comm/"))}, sorted(logged)


SCRIPT = str(SCRIPTS / "monitor_run.py")
BUDGET = 120
"""Seconds for one 2-process launch of the runs below (about 8 s for one run on 2 idle cores), at
most half the 300 s test timeout."""
STEPS = 6
RATIO_TOL = 0.01
"""Compression ratios: DDP() 1 and fp16 0.5 up to the few bytes of the per-step train_loss sync
(4 bytes per batch on 121,728 reference bytes: 3.3e-5)."""


LIGHTNING_RUNS = {"DDP-1": ("DDP", 1), "fp16-1": ("fp16", 1), "DDP-2": ("DDP", 2)}
"""Run name -> (strategy, accumulate), launched by Lightning."""
HOROVOD_RUNS = ("horovod", "horovod_fp16")
"""Strategies run under mpirun."""


def launch(root: Path, runs: dict[str, tuple[str, int]], launcher: list[str]) -> Path:
    """``runs`` (name -> strategy, accumulate) one after another in one launch; each writes to ``root / name``."""
    run_in_sequence(
        [["monitor_run.py", "--strategy", strategy, "--accumulate", str(accumulate), "--out", str(root / name)]
         for name, (strategy, accumulate) in runs.items()],
        BUDGET,
        launcher,
    )  # fmt: skip
    return root


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return launch(tmp_path_factory.mktemp("lightning"), LIGHTNING_RUNS, [sys.executable])


@pytest.fixture(scope="module")
def horovod_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    runs = {strategy: (strategy, 1) for strategy in HOROVOD_RUNS}
    return launch(tmp_path_factory.mktemp("horovod"), runs, [*MPIRUN_TWO_RANKS, sys.executable])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "accumulate", "ratio"), [("DDP", 1, 1.0), ("fp16", 1, 0.5), ("DDP", 2, 1.0)]
)
def test_two_ranks_logged_metrics(lightning_runs: Path, strategy: str, accumulate: int, ratio: float) -> None:
    check_logged_metrics(lightning_runs / f"{strategy}-{accumulate}", accumulate, ratio)


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.parametrize(("strategy", "ratio"), [("horovod", 1.0), ("horovod_fp16", 0.5)])
def test_two_horovod_ranks_logged_metrics(horovod_runs: Path, strategy: str, ratio: float) -> None:
    """The same counters under Horovod (mpirun, one process per rank); its all-reduces, one per
    tensor, overlap each other; the busy time counts them once, so the share stays below 1."""
    check_logged_metrics(horovod_runs / strategy, 1, ratio)


def check_logged_metrics(tmp_path: Path, accumulate: int, ratio: float) -> None:
    with open(tmp_path / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("comm/bytes_sent")]
    assert [int(r["step"]) for r in rows] == list(range(STEPS))  # one row per optimizer step
    for rank in (0, 1):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        history, counters = info["history"], info["counters"]
        assert info["world_size"] == 2 and info["global_step"] == STEPS and len(history) == STEPS
        # every byte the collectives counted during training falls in exactly one step
        for key in ("bytes_sent", "bytes_received"):
            total = counters["end"][key] - counters["start"][key]
            assert sum(h[f"comm/{key}"] for h in history) == total, key
        sent_per_step = (counters["end"]["bytes_sent"] - counters["start"]["bytes_sent"]) / STEPS
        reference = ring_all_reduce_bytes(4 * info["gradient_numel"], 2)
        samples = accumulate * info["batch_size"]
        assert info["samples"] == [samples] * STEPS
        for h in history:
            assert h["comm/bytes_sent"] == sent_per_step  # the same collectives every step
            assert h["comm/compression_ratio"] == pytest.approx(ratio, abs=RATIO_TOL)
            assert h["comm/compression_ratio"] == pytest.approx(h["comm/bytes_sent"] / reference, rel=1e-12)
            assert 0 < h["comm/share"] < 1
            assert h["comm/share"] == pytest.approx(h["comm/seconds"] / h["perf/step_seconds"], rel=1e-12)
            sps = samples * 2 / h["perf/step_seconds"]
            assert h["perf/samples_per_s"] == pytest.approx(sps, rel=1e-12) and sps > 0
            assert h["perf/tokens_per_s"] == pytest.approx(sps * info["seq_len"], rel=1e-12)
            assert h["perf/scaling_efficiency"] == pytest.approx(sps / (2 * 100.0), rel=1e-12)
        if rank == 0:  # the CSVLogger file is rank 0's
            assert {"perf/samples_per_s", "comm/share"} <= set(info["progress_bar_keys"])
            for row, h in zip(rows, history):
                for key in (
                    "comm/bytes_sent",
                    "comm/bytes_received",
                    "comm/compression_ratio",
                    "perf/samples_per_s",
                ):
                    assert float(row[key]) == pytest.approx(h[key], rel=1e-6), key


def test_busy_seconds_count_overlapping_collectives_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist.collectives.accounting import CommStats

    stats = CommStats()
    stats.enter(0)
    stats.enter(10)  # posted while the first is in flight
    stats.leave(20)
    stats.leave(30)
    assert stats.busy_seconds == pytest.approx(30e-9)  # [0, 30], not 30 + 10
    stats.add_busy(5e-9)  # a caller-driven exchange with nothing in flight
    stats.enter(100)
    stats.add_busy(1.0)  # inside an open interval: already covered by it
    stats.leave(150)
    assert stats.busy_seconds == pytest.approx(85e-9)
    assert stats.snapshot()["busy_seconds"] == pytest.approx(85e-9)
    monkeypatch.setattr("time.perf_counter_ns", lambda: 1_000)
    stats.reset()
    stats.enter(1_000)
    monkeypatch.setattr("time.perf_counter_ns", lambda: 1_400)
    assert stats.busy_seconds == pytest.approx(400e-9)  # an open interval counts up to now
