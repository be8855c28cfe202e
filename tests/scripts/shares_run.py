"""Fit a small regression MLP with per-rank batch shares (or without, the reference) and save each
rank's final weights and the dataset indices it trained at every step.

python tests/scripts/shares_run.py --out DIR --strategy ddp|compressed|sharded [--shares 3,1]
    [--balance WINDOW --cost 1,3] [--steps 8] [--accumulate 1] [--ckpt-at K] [--resume CKPT]

``--balance`` turns the balancer on with a fake clock: rank r's ``training_step`` "takes"
``cost[r]`` seconds per sample, so its decisions are deterministic.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rank_io import cpu_trainer, parse, save_fitted
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist.algorithms.batch_shares import Balance
from lightning_dist.strategies.sharded import Sharded

SAMPLES, FEATURES, BATCH = 64, 6, 4


class Regression(L.LightningModule):
    """An MLP on (index, x, y) samples; it keeps the indices of every batch it trains."""

    def __init__(self, costs: list[float], workers: int = 0) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.costs = costs
        self.fake_time = 0.0
        self.seen: list[list[int]] = []
        self.workers = workers

    def fake_clock(self) -> float:
        return self.fake_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.append([self.trainer.global_step, *idx.tolist()])
        self.fake_time += self.costs[self.global_rank] * len(idx)
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, FEATURES, generator=g)
        y = x @ torch.randn(FEATURES, generator=g) + 0.1 * torch.randn(SAMPLES, generator=g)
        return DataLoader(
            TensorDataset(torch.arange(SAMPLES), x, y),
            batch_size=BATCH,
            shuffle=False,
            num_workers=self.workers,
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--shares", default="")
    p.add_argument("--balance", type=int, default=0)
    p.add_argument("--cost", default="1,1")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--ckpt-at", type=int, default=0)
    p.add_argument("--resume", default=None)
    a = parse(p, argv)
    shares: Any = [float(s) for s in a.shares.split(",")] if a.shares else None
    if a.balance:
        shares = Balance(window=a.balance, min_change=0.0)
    if a.strategy == "ddp":
        strategy: Any = lightning_dist.DDP(shares=shares)
    elif a.strategy == "compressed":
        strategy = lightning_dist.Compressed("none", shares=shares)
    else:
        strategy = Sharded(shares=shares)
    L.seed_everything(7, verbose=False)
    trainer = cpu_trainer(
        2,
        strategy,
        a.steps,
        enable_checkpointing=bool(a.ckpt_at),
        logger=False,
        accumulate_grad_batches=a.accumulate,
    )
    if a.ckpt_at:
        trainer.callbacks.append(
            ModelCheckpoint(dirpath=a.out, filename="at-{step}", every_n_train_steps=a.ckpt_at, save_top_k=-1)
        )
    model = Regression([float(c) for c in a.cost.split(",")], a.workers)
    if strategy.batch_shares is not None:
        strategy.batch_shares.clock = model.fake_clock
    trainer.fit(model, ckpt_path=a.resume)
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    holder = nn.Module()
    for k, v in weights.items():
        holder.register_buffer(k.replace(".", "_"), v.detach().cpu().clone())
    part = strategy.batch_shares
    save_fitted(
        a.out,
        trainer,
        holder,
        seen=model.seen,
        changes=[] if part is None else part.changes,
        schedule=[] if part is None else part.schedule.state_dict(),
    )


if __name__ == "__main__":
    main()
    lightning_dist.collectives.shutdown()
