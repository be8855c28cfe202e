"""Uneven ranks: uniform DDP() against DDP(shares="balanced") with one rank at half speed, 2 CPU processes.

    python benchmarks/bench_uneven_ranks.py [--steps 60] [--batch 64] [--delay-ms 1.0] [--window 5]

The slow rank, stated and reproducible: every rank's training_step sleeps ``delay-ms`` per sample
(the stand-in for a model's compute, so the figures do not depend on how 2 shared cores are
scheduled), and rank 1 sleeps twice that, so it trains at half the speed of rank 0. Both fits run in
one launch (Lightning's, 2 processes), on a small MLP with B = 2 x ``batch`` samples per step.

Rows: samples per second (median over the steps after the first ``skip``; a step's rate is B over
the time between consecutive step ends on rank 0) of uniform DDP(), of DDP(shares=Balance(window))
and of the ideal, the sum of the two ranks' own rates (each rank's samples over its seconds in
training_step, from the uniform run); ratios against the ideal and against uniform.
Target: balanced >= 0.9 of ideal, where uniform is about 2/3.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
from machine_info import machine  # benchmarks/ is on sys.path when a benchmark runs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist.algorithms.batch_shares import Balance
from lightning_dist.workload.trainer import quiet_trainer

FEATURES = 32


class Slowed(L.LightningModule):
    """An MLP whose training_step sleeps ``delay[rank]`` seconds per sample, and times itself."""

    def __init__(self, delay: list[float]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
        self.delay = delay
        self.busy = 0.0
        self.samples = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        x, y = batch
        time.sleep(self.delay[self.global_rank] * len(x))
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.busy += time.perf_counter() - start
        self.samples += len(x)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(L.Callback):
    """Rank 0's time at every step end, and each rank's own rate gathered at the end of fit."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.own_rates: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        own = torch.tensor([pl_module.samples / pl_module.busy], dtype=torch.float64)
        self.own_rates = [float(r) for r in pl_module.all_gather(own).flatten()]


def fit(strategy: Any, a: argparse.Namespace) -> tuple[list[float], list[float], Any]:
    n = 2 * a.batch * (a.steps + 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(-1)), batch_size=a.batch)
    delay = a.delay_ms / 1e3
    model = Slowed([delay, 2 * delay])
    clock = StepClock()
    trainer = quiet_trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=a.steps, limit_val_batches=0,
        enable_checkpointing=False, logger=False, callbacks=[clock],
    )  # fmt: skip
    trainer.fit(model, data)
    rates = [2 * a.batch / (t1 - t0) for t0, t1 in zip(clock.ends[a.skip :], clock.ends[a.skip + 1 :])]
    return rates, clock.own_rates, trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64, help="per-rank batch of the uniform run (B = 2 x batch)")
    p.add_argument(
        "--delay-ms", type=float, default=1.0, help="rank 0's sleep per sample; rank 1's is twice it"
    )
    p.add_argument("--window", type=int, default=5, help="the balancer's steps per measurement")
    p.add_argument(
        "--skip", type=int, default=15, help="steps left out of the medians (warm-up, first window)"
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    uniform, own, trainer = fit(lightning_dist.DDP(), a)
    balanced_strategy = lightning_dist.DDP(shares=Balance(window=a.window))
    balanced, _, trainer = fit(balanced_strategy, a)
    if trainer.global_rank != 0:
        return
    part = balanced_strategy.batch_shares
    assert part is not None
    ideal = sum(own)
    u, b = statistics.median(uniform), statistics.median(balanced)
    print(f"machine: {machine()}")
    print(f"command: python benchmarks/bench_uneven_ranks.py --steps {a.steps} --batch {a.batch} "
          f"--delay-ms {a.delay_ms} --window {a.window} --skip {a.skip}")  # fmt: skip
    print(
        f"slowed rank: training_step sleeps {a.delay_ms} ms per sample on rank 0, {2 * a.delay_ms} ms on rank 1"
    )
    print(f"own rates (samples/s, rank 0, rank 1): {own[0]:.0f}, {own[1]:.0f}")
    print(f"balanced shares: {part.changes} (first step, shares of B={part.total})")
    print(f"{'run':<34}{'samples/s':>12}{'/ ideal':>10}{'/ uniform':>11}")
    for name, rate in (
        ("uniform DDP()", u),
        (f"DDP(shares=Balance(window={a.window}))", b),
        ("ideal (sum of own rates)", ideal),
    ):
        print(f"{name:<34}{rate:>12.0f}{rate / ideal:>10.3f}{rate / u:>11.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
    lightning_dist.collectives.shutdown()
