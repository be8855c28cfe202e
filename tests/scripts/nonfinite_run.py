"""Fit the tiny workload with ``skip_nonfinite=True`` while one rank's gradients turn NaN at one step.

python tests/scripts/nonfinite_run.py --strategy ddp|powersgd|elastic --nan-rank 1 --nan-step 3 --out DIR

The NaN is written into rank ``--nan-rank``'s gradient *after* the gradient reduction, so only that
rank sees it: without the all-reduced flag the other rank would step and the ranks would diverge.
Each rank saves its final weights, the sum of its parameters after every optimizer step, and its
count of skipped steps.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from rank_io import parse, save_fitted

import lightning_dist
from lightning_dist import collectives
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


class PoisonedGradient(TinyCausalLM):
    """The tiny workload; rank ``nan_rank`` gets a NaN gradient entry at optimizer step ``nan_step``."""

    def __init__(self, nan_rank: int, nan_step: int) -> None:
        super().__init__(WorkloadConfig.tiny(seed=7))
        self.nan_rank, self.nan_step = nan_rank, nan_step
        self.param_sums: list[float] = []

    def on_after_backward(self) -> None:
        if self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_step:
            grad = self.head.weight.grad
            assert grad is not None
            grad[0, 0] = float("nan")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.param_sums.append(sum(float(p.detach().double().sum()) for p in self.parameters()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=["ddp", "powersgd", "elastic"], required=True)
    p.add_argument("--nan-rank", type=int, default=1)
    p.add_argument("--nan-step", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=6)
    a = parse(p, argv)
    strategy: Any
    if a.strategy == "ddp":
        strategy = lightning_dist.DDP(skip_nonfinite=True)
    elif a.strategy == "powersgd":
        strategy = lightning_dist.Compressed("powersgd", skip_nonfinite=True, warmup=0)
    else:  # skip_nonfinite is Elastic's default
        strategy = lightning_dist.Elastic(commit_every=2, dirpath=os.path.join(a.out, "commits"))
    L.seed_everything(7, verbose=False)
    model = PoisonedGradient(a.nan_rank, a.nan_step)
    trainer = quiet_trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=a.max_steps)
    trainer.fit(model)
    save_fitted(
        a.out,
        trainer,
        model,
        param_sums=model.param_sums,
        skipped=strategy.nonfinite.skipped,
        logged=float(trainer.callback_metrics.get("skipped_nonfinite_steps", torch.tensor(-1.0))),
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
