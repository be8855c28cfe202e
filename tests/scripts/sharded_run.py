"""Fit with Sharded (and its references) several times, one after another, in one job.

python tests/scripts/sharded_run.py --out DIR --devices N --runs JSON

JSON is a list of runs; each has a ``name`` and any of: ``strategy`` ("sharded", "model_parallel"
= Lightning's ModelParallelStrategy, "ddp" = the pack's DDP), ``options`` (the strategy's keyword
arguments), ``model`` ("lm": the workload, sharded by Sharded's default policy; "lm_user": the
workload whose configure_model shards it over ``device_mesh["data_parallel"]``; "lm_docs": the
workload whose configure_model shards each layer, then itself, over the whole ``device_mesh``, as
Lightning's docs show for ModelParallelStrategy; "lm_tied": the workload with its head tied to its
embedding and no parameter of its own, the default policy; "mlp": a small MLP of Linear layers,
the default policy), ``optimizer`` ("adamw", "sgd"), ``lr``, ``steps`` or
``epochs`` with ``batches_per_epoch``, ``save`` (checkpoint written after fitting), ``save_in_fit``
(checkpoint written by the last hook of ``fit``), ``resume``
(fit from this checkpoint), ``record`` (keep every rank's batches and the initial weights).

Rank 0 writes ``<name>.pt`` (the full final weights, gathered); every rank writes
``<name>.rank<r>.json`` (bytes by op, loss, first and last batch's loss on that rank, the pack's
warnings, torch's warnings that Sharded silences, how many gradient collectives were left in flight)
and with ``record`` ``<name>.rank<r>.batches.pt``.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from rank_io import RecordBatches, save_info
from run_options import fit_each_run, trainer_length
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist.layout.sharding_policy import shard_by_layer
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

TORCH_TEXTS = ("Slicing a flattened dim from root mesh", "returned a view tensor")
"""torch's warnings that a plain module under Sharded should not show (its mesh deprecation, FSDP2's
view outputs)."""
MLP_SIZES = (12, 40, 24, 3)
"""The MLP's widths: its weights split unevenly over 4 shards (FSDP2 pads them)."""


class LM(TinyCausalLM):
    """The workload with a choice of optimizer."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.config.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.config.lr, weight_decay=0.01)


class UserLM(LM):
    """What a ModelParallelStrategy user writes: fully_shard in configure_model."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        assert mesh is not None
        shard_by_layer(self, mesh["data_parallel"])


class DocsLM(LM):
    """What Lightning's docs show for ModelParallelStrategy: each layer, then the model, sharded over
    the strategy's device mesh (ModelParallelStrategy's (data_parallel, tensor_parallel) of (2, 1);
    Sharded's (replicate, shard) of (1, 2))."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        assert mesh is not None
        for layer in self.blocks.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class TiedLM(LM):
    """The workload with its output head's weight tied to its input embedding (as GPT-2's), the
    positions an embedding of their own, so that the LightningModule holds no parameter itself: the
    default policy makes it the unit of the embedding and the head (no other unit holds both)."""

    def __init__(self, optimizer: str, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        cfg = self.config
        del self.pos
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(cfg.seed + 1)
            self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)
            nn.init.normal_(self.embed.weight, std=0.1)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.positions(torch.arange(t, device=tokens.device))
        mask: torch.Tensor = self.causal_mask  # type: ignore[assignment]
        h = self.blocks(h, mask=mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class BatchLosses(L.Callback):
    """This rank's loss of the first and of the last batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *_: Any
    ) -> None:
        self.losses.append(float(outputs["loss"]))


class MLP(L.LightningModule):
    """A small MLP on fixed random data; plain SGD, so a step is -lr times the synced gradient."""

    def __init__(self, lr: float, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(3)
        sizes = MLP_SIZES
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.Tanh()]
        self.net = nn.Sequential(*layers[:-1])
        self.lr = lr
        self.optimizer_name = optimizer
        g = torch.Generator().manual_seed(5)
        self.data = TensorDataset(
            torch.randn(256, sizes[0], generator=g), torch.randn(256, sizes[-1], generator=g)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=True, drop_last=True)


class SaveAtTrainEnd(L.Callback):
    """Saves a checkpoint from inside ``fit``, at its last hook (as ModelCheckpoint saves)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def make_model(run: dict[str, Any]) -> L.LightningModule:
    kind = run.get("model", "lm")
    optimizer = run.get("optimizer", "adamw" if kind != "mlp" else "sgd")
    if kind == "mlp":
        return MLP(run.get("lr", 0.1), optimizer)
    config = WorkloadConfig.tiny(seed=7, lr=run.get("lr", 3e-3), n_layers=2)
    models = {"lm": LM, "lm_user": UserLM, "lm_docs": DocsLM, "lm_tied": TiedLM}
    return models[kind](optimizer, config=config)


def make_strategy(run: dict[str, Any], devices: int) -> Any:
    name = run.get("strategy", "sharded")
    options = run.get("options", {})
    if name == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1, **options)
    if name == "ddp":
        return lightning_dist.DDP(**options)
    return lightning_dist.Sharded(**options)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered (a collective: every rank calls it)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in model.state_dict().items()
    }


def fit(run: dict[str, Any], out: str, devices: int) -> None:
    start = time.perf_counter()
    L.seed_everything(7, verbose=False)
    model = make_model(run)
    record, losses = RecordBatches(), BatchLosses()
    callbacks: list[L.Callback] = [losses, record] if run.get("record") else [losses]
    if run.get("save_in_fit"):
        callbacks.append(SaveAtTrainEnd(run["save_in_fit"]))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=make_strategy(run, devices),
        callbacks=callbacks,
        **trainer_length(run, default_steps=10),
        limit_val_batches=0,
        deterministic=True,
    )
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()} if run.get("record") else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    weights = full_weights(model)
    rank = trainer.global_rank
    comm = getattr(trainer.strategy, "communicator", None)
    info: dict[str, Any] = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "train_loss": float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan")))),
        "bytes_sent": comm.stats.bytes_sent if comm is not None else None,
        "bytes_by_op": {op: s.bytes_sent for op, s in comm.stats.per_op.items()} if comm is not None else {},
        "warnings": [str(w.message) for w in caught if "Sharded" in str(w.message)],
        "torch_warnings": sorted(
            {str(w.message) for w in caught if any(t in str(w.message) for t in TORCH_TEXTS)}
        ),
        "first_loss": losses.losses[0] if losses.losses else None,
        "last_loss": losses.losses[-1] if losses.losses else None,
        "fsdp_modules": len(getattr(trainer.strategy, "fsdp_modules", [])),
        "deferred": getattr(getattr(trainer.strategy, "pending_gradients", None), "deferred", None),
        "seconds": time.perf_counter() - start,
    }
    if rank == 0:
        torch.save(weights, os.path.join(out, f"{run['name']}.pt"))
    if initial is not None:
        torch.save(
            {"initial": initial, "batches": record.batches},
            os.path.join(out, f"{run['name']}.rank{rank}.batches.pt"),
        )
    save_info(out, f"{run['name']}.rank{rank}.json", info)


def main(argv: list[str] | None = None) -> None:
    fit_each_run(fit, argv)


if __name__ == "__main__":
    main()
