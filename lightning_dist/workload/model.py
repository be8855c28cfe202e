"""The embedded workload: a small byte-level causal transformer language model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.workload.data import TextBlocks, load_corpus

VOCAB_SIZE = 256


@dataclass
class WorkloadConfig:
    """Sizes of the model and data; the defaults make an epoch about a minute on 2 CPU processes."""

    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads per block."""
    seq_len: int = 128
    """Tokens (bytes) per training window."""
    batch_size: int = 16
    """Windows per rank per step."""
    train_bytes: int = 2_000_000
    """Bytes of standard-library source used for training."""
    val_bytes: int = 200_000
    """Bytes used for validation."""
    lr: float = 3e-3
    """Learning rate."""
    optimizer: str = "adamw"
    """'adamw' or 'sgd' (SGD with momentum 0.9)."""
    seed: int = 1234
    """Seed for initial weights."""

    @classmethod
    def tiny(cls, **overrides: Any) -> WorkloadConfig:
        """A few-second size for tests: same code paths, 40 kB of text, one small block."""
        sizes: dict[str, Any] = dict(
            d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=4, train_bytes=40_000, val_bytes=8_000
        )
        return cls(**{**sizes, **overrides})

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r}; accepted: 'adamw', 'sgd'")
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "train_bytes", "val_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


class TinyCausalLM(L.LightningModule):
    """Byte-level causal transformer; logs ``train_loss``, ``val_loss`` and ``val_acc`` globally."""

    def __init__(self, config: WorkloadConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        cfg = config or WorkloadConfig()
        if overrides:
            cfg = WorkloadConfig(**{**cfg.__dict__, **overrides})
        self.config = cfg
        self.save_hyperparameters({"config": cfg.__dict__})
        # CPU generator only: forking or seeding the CUDA generators would initialise CUDA in this
        # process (a notebook kernel), and a fork launch of GPU ranks would then fail.
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(cfg.seed)
            self.embed = nn.Embedding(VOCAB_SIZE, cfg.d_model)
            self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model))
            layer = nn.TransformerEncoderLayer(
                cfg.d_model, cfg.n_heads, 4 * cfg.d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, VOCAB_SIZE)
        self.register_buffer(
            "causal_mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq_len), persistent=False
        )
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB_SIZE, average="micro")

    @override
    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        mask: Tensor = self.causal_mask  # type: ignore[assignment]
        h = self.blocks(h, mask=mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), logits

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.val_acc(logits.flatten(0, 1), batch[1].flatten())
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_acc)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.config.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.config.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.config.lr, weight_decay=0.01)

    @override
    def train_dataloader(self) -> DataLoader:
        data = TextBlocks(load_corpus("train", self.config.train_bytes), self.config.seq_len)
        return DataLoader(data, batch_size=self.config.batch_size, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        data = TextBlocks(load_corpus("val", self.config.val_bytes), self.config.seq_len)
        return DataLoader(data, batch_size=self.config.batch_size, drop_last=False)
