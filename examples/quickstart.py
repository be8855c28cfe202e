"""Train your own LightningModule with any lightning_dist strategy: copy this file, replace the model.

One box, as many processes as devices (every GPU when there are GPUs, 2 CPU processes otherwise):

    python examples/quickstart.py                                   # DDP() on every GPU / 2 CPU processes
    python examples/quickstart.py --strategy ld_compressed_int8     # any registered name
    python examples/quickstart.py --strategy ddp                    # Lightning's own DDP, to compare
    python examples/quickstart.py --strategy ld_sharded_int8        # FSDP2 shards, int8 reduce-scatter
    python examples/quickstart.py --logger tensorboard              # CommMonitor figures in TensorBoard

Launchers that start the processes themselves (the script reads their environment):

    torchrun --nproc-per-node 8 examples/quickstart.py
    torchrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/quickstart.py --strategy ld_elastic
    srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 python examples/quickstart.py
    horovodrun -np 8 python examples/quickstart.py --strategy ld_horovod_adasum
    horovodrun -np 8 --min-np 4 --max-np 16 --host-discovery-script ./discover.sh \
        --network-interface eth0 python examples/quickstart.py --strategy ld_horovod_elastic
    mpirun -np 8 python examples/quickstart.py --strategy ld_horovod

`lightning-dist strategies` lists every name; `lightning-dist slurm` writes an sbatch script.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401  (registers the ld_* strategy names)
from lightning_dist.callbacks import CommMonitor


class Classifier(L.LightningModule):
    """A small MLP classifier: put your own model here."""

    def __init__(self, features: int = 32, hidden: int = 256, classes: int = 10, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val/loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val/acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_data(samples: int, features: int = 32, classes: int = 10, seed: int = 0) -> TensorDataset:
    """A learnable synthetic task: the class is the argmax of a fixed random projection of x."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    projection = torch.randn(features, classes, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ projection).argmax(-1))


def launched_devices() -> tuple[int, int] | None:
    """(devices per node, nodes) when a launcher started this process, else None (Lightning starts them)."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "HOROVOD_RANK" in os.environ:
        return 1, 1  # mpirun/horovodrun: one device per process, Horovod knows the rest
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        return local, max(1, int(os.environ["WORLD_SIZE"]) // local)
    if "SLURM_NTASKS_PER_NODE" in os.environ and "SLURM_STEP_ID" in os.environ:  # srun
        return int(os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0]), int(
            os.environ.get("SLURM_NNODES", "1")
        )
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small classifier with a lightning_dist strategy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--strategy", default="ld_ddp", help="a registered name (lightning-dist strategies)")
    p.add_argument("--accelerator", default="auto", help="auto: gpu when there are GPUs, else cpu")
    p.add_argument(
        "--devices", default="auto", help="per node; auto: every GPU, or 2 CPU processes, or the launcher's"
    )
    p.add_argument("--num-nodes", type=int, default=None, help="nodes; None: 1, or the launcher's")
    p.add_argument("--precision", default=None, help="e.g. bf16-mixed on GPUs; None: Lightning's (32-true)")
    p.add_argument("--max-epochs", type=int, default=3, help="passes over the training data")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--samples", type=int, default=4096, help="training samples (validation: a quarter)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument(
        "--logger", choices=("none", "csv", "tensorboard"), default="none", help="where metrics go"
    )
    p.add_argument("--root-dir", default="runs/quickstart", help="logs and checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--metrics-json", default=None, help="also write rank 0's final metrics to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    gpu = args.accelerator == "gpu" or (args.accelerator == "auto" and torch.cuda.is_available())
    launched = launched_devices()
    devices: int | str = args.devices
    num_nodes = args.num_nodes or 1
    if args.devices == "auto":
        if launched is not None:
            devices, num_nodes = launched[0], args.num_nodes or launched[1]
        else:
            devices = -1 if gpu else 2  # every GPU; 2 CPU processes
    else:
        devices = int(args.devices)
    logger: object = False
    if args.logger == "csv":
        logger = L.pytorch.loggers.CSVLogger(args.root_dir)
    elif args.logger == "tensorboard":
        logger = L.pytorch.loggers.TensorBoardLogger(
            args.root_dir
        )  # pip install tensorboard (or tensorboardX)

    def make_trainer() -> L.Trainer:
        return L.Trainer(
            accelerator="gpu" if gpu else "cpu",
            devices=devices,
            num_nodes=num_nodes,
            strategy=args.strategy,
            precision=args.precision,
            max_epochs=args.max_epochs,
            logger=logger,  # type: ignore[arg-type]
            callbacks=[CommMonitor()],
            default_root_dir=args.root_dir,
            enable_checkpointing=False,
            log_every_n_steps=10,
        )

    # ld_horovod_elastic: Horovod's elastic engine refits (a new Trainer) after every host change or failure
    elastic = args.strategy == "ld_horovod_elastic"
    trainer = None if elastic else make_trainer()
    model = Classifier(lr=args.lr)
    train = DataLoader(make_data(args.samples, seed=args.seed), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(make_data(args.samples // 4, seed=args.seed + 1), batch_size=args.batch_size)
    if trainer is None:
        from lightning_dist.launch.horovod_elastic import fit_horovod_elastic

        trainer = fit_horovod_elastic(make_trainer, model, train_dataloaders=train, val_dataloaders=val)
    else:
        trainer.fit(model, train, val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        print(
            f"world size {trainer.world_size}: "
            + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
        )
        if args.metrics_json:
            with open(args.metrics_json, "w") as fh:
                json.dump({"world_size": trainer.world_size, **metrics}, fh)
    return metrics


if __name__ == "__main__":
    main()
