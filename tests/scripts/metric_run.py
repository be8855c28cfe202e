"""Validate with 2 ranks: a torchmetrics Accuracy and sync_dist logging must give global values.

python tests/scripts/metric_run.py --strategy ld_ddp --out FILE
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  (registers strategy names)
from lightning_dist import collectives

N, CLASSES = 40, 4


def dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(N, CLASSES, generator=gen)
    target = torch.randint(0, CLASSES, (N,), generator=gen)
    return TensorDataset(logits, target)


class Probe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.seen = 0

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        logits, target = batch
        self.seen += len(target)
        self.acc(logits, target)
        self.log("acc", self.acc)
        self.log("rank_plus_one", float(self.global_rank + 1), sync_dist=True)
        self.log("rank_sum", float(self.global_rank + 1), sync_dist=True, reduce_fx="sum")

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=5)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ld_ddp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    model = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=a.devices,
        strategy=a.strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    metrics = trainer.validate(model, verbose=False)[0]
    if trainer.global_rank == 0:
        with open(a.out, "w") as fh:
            json.dump({**{k: float(v) for k, v in metrics.items()}, "seen_rank0": model.seen}, fh)


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
