"""A user's own script: a small LightningModule trained with ``DDP()`` on 2 CPU processes.

tests/test_pip_install.py copies it out of the repository and runs it with the interpreter of a fresh
virtualenv where only the built wheel (and its dependencies) is installed. Rank 0 prints one JSON line:
where lightning_dist was imported from, its version, the world size and the first and last loss.
"""

from __future__ import annotations

import json

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist import DDP


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=gen)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Regression()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDP(), max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    if trainer.is_global_zero:
        print(json.dumps({"package": lightning_dist.__file__, "version": lightning_dist.__version__,
                          "world_size": trainer.world_size, "losses": model.losses}))  # fmt: skip
