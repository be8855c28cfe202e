"""Fit a tiny model that rank 1 builds differently from rank 0; each rank records the error it got.

python tests/scripts/mismatched_model.py --strategy ddp|compressed --out DIR          (2 CPU ranks)
torchrun --standalone --nproc-per-node=2 --max-restarts=0 tests/scripts/mismatched_model.py --strategy elastic --out DIR
mpirun -np 2 python tests/scripts/mismatched_model.py --strategy horovod|horovod_adasum --out DIR

``--mismatch shape``: rank 1's first layer is ``Linear(8, 5)`` where rank 0 has ``Linear(8, 4)``;
``--mismatch extra``: rank 1 has one more layer. Each rank writes ``rank{r}.json`` (``type`` and
``message`` of the exception ``fit`` raised, both None when it raised none), waits up to
``--wait`` seconds for the other ranks' files (so no launcher kills a rank that has not written its
own yet), and exits 1 if ``fit`` raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

import lightning as L
import torch
from rank_io import parse
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist import collectives
from lightning_dist.workload.trainer import quiet_trainer


class RankDependent(L.LightningModule):
    """A two-layer regression whose layers are built in ``configure_model``, where the rank is known."""

    def __init__(self, mismatch: str) -> None:
        super().__init__()
        self.mismatch = mismatch
        self.net: Optional[nn.Sequential] = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        odd = self.global_rank == 1
        width = 5 if odd and self.mismatch == "shape" else 4
        layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1)]
        if odd and self.mismatch == "extra":
            layers.append(nn.Linear(1, 1))
        self.net = nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        assert self.net is not None
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 1)), batch_size=4)


def make_strategy(name: str, out: str) -> tuple[Any, int]:
    """The strategy and the Trainer's ``devices`` (1 where the launcher starts one process per rank)."""
    if name == "ddp":
        return lightning_dist.DDP(), 2
    if name == "compressed":
        return lightning_dist.Compressed("powersgd", rank=1), 2
    if name == "elastic":
        strategy = lightning_dist.Elastic(commit_every=2, dirpath=os.path.join(out, "commits"))
        return strategy, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if name == "horovod":
        return lightning_dist.Horovod(), 1
    return lightning_dist.HorovodAdasum(), 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--strategy", choices=["ddp", "compressed", "elastic", "horovod", "horovod_adasum"], required=True
    )
    p.add_argument("--mismatch", choices=["shape", "extra"], default="shape")
    p.add_argument("--wait", type=float, default=30.0)
    a = parse(p, argv)
    os.makedirs(a.out, exist_ok=True)
    L.seed_everything(7, verbose=False)
    strategy, devices = make_strategy(a.strategy, a.out)
    trainer = quiet_trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, limit_val_batches=0
    )
    error: Optional[BaseException] = None
    try:
        trainer.fit(RankDependent(a.mismatch))
    except Exception as exc:  # recorded for the test, then the exit status says it failed
        error = exc
    rank, world = trainer.global_rank, trainer.world_size
    path = os.path.join(a.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(
            {
                "rank": rank,
                "world_size": world,
                "type": None if error is None else type(error).__name__,
                "message": None if error is None else str(error),
            },
            fh,
        )
    os.replace(path + ".tmp", path)  # whole, once another rank sees it
    deadline = time.monotonic() + a.wait
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(a.out, f"rank{r}.json")) for r in range(world)):
            break
        time.sleep(0.1)
    return 0 if error is None else 1


if __name__ == "__main__":
    code = main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
    sys.exit(code)
