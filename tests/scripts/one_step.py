"""One optimizer step of the tiny workload; each rank saves the starting weights, its own batch and
the weights after the step, so a test can recompute the step with an independent reference.

python tests/scripts/one_step.py --strategy ld_ddp_adasum --optimizer sgd --out DIR
horovodrun --mpi -np 2 python tests/scripts/one_step.py --strategy horovod_adasum --devices 1 --optimizer adam --out DIR
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from script_setup import cpu_trainer, parse
from torch import Tensor

import lightning_dist  # noqa: F401  (registers the strategy names)
from lightning_dist import collectives
from lightning_dist.workload import TinyCausalLM, WorkloadConfig


class OneStep(TinyCausalLM):
    """The tiny workload with a plain optimizer (no momentum or weight decay) that keeps its batch."""

    def __init__(self, optimizer: str, lr: float) -> None:
        super().__init__(WorkloadConfig.tiny(seed=7))
        self.optimizer_name, self.lr = optimizer, lr
        self.seen: list[Tensor] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.seen = [t.detach().clone() for t in batch]
        return super().training_step(batch, batch_idx)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--optimizer", choices=["sgd", "adam"], required=True)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    a = parse(p, argv)
    L.seed_everything(7, verbose=False)
    model = OneStep(a.optimizer, a.lr)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = cpu_trainer(a.devices, a.strategy, max_steps=1)
    trainer.fit(model)
    os.makedirs(a.out, exist_ok=True)
    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    result = {"start": start, "final": final, "batch": model.seen, "world_size": trainer.world_size}
    torch.save(result, os.path.join(a.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
