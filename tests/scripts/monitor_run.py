"""Fit the tiny workload on 2 CPU ranks with a CommMonitor and a CSVLogger; each rank writes what
the test checks the logged metrics against.

python tests/scripts/monitor_run.py --strategy DDP|fp16 --out DIR [--accumulate 2] [--max-steps 6]
mpirun -np 2 python tests/scripts/monitor_run.py --strategy horovod|horovod_fp16 --out DIR

DIR/metrics.csv: the CSVLogger file (rank 0). DIR/rank{r}.json: the monitor's per-step history, the
collectives counters at the start and end of training, the trainable element count, the world
size, the progress-bar keys and the batch shape.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from rank_io import parse, save_info

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import CommMonitor
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


class Counters(L.Callback):
    """The strategy's communicator's counters when training starts and ends (outside the monitor's
    windows)."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at["start"] = trainer.strategy.communicator.stats.snapshot()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at["end"] = trainer.strategy.communicator.stats.snapshot()


STRATEGIES: dict[str, Callable[[], Any]] = {
    "DDP": lambda: lightning_dist.DDP(),
    "fp16": lambda: lightning_dist.Compressed("fp16"),
    "horovod": lambda: lightning_dist.Horovod(),
    "horovod_fp16": lambda: lightning_dist.Horovod(compression="fp16"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=list(STRATEGIES), default="DDP")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=6)
    a = parse(p, argv)
    strategy = STRATEGIES[a.strategy]()
    L.seed_everything(7, verbose=False)
    config = WorkloadConfig.tiny(seed=7)
    model = TinyCausalLM(config)
    monitor = CommMonitor(warmup=1, single_process_samples_per_s=100.0)
    counters = Counters()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1 if a.strategy.startswith("horovod") else 2,  # Horovod: one process per mpirun rank
        strategy=strategy,
        max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate,
        limit_val_batches=0,
        logger=CSVLogger(a.out, name="", version=""),
        log_every_n_steps=1,
        callbacks=[monitor, counters],
        deterministic=True,
    )
    trainer.fit(model)
    info = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "history": monitor.history,
        "samples": monitor.samples,
        "summary": monitor.summary(),
        "counters": counters.at,
        "gradient_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "progress_bar_keys": sorted(trainer.progress_bar_metrics),
        "batch_size": config.batch_size,
        "seq_len": config.seq_len,
    }
    save_info(a.out, f"rank{trainer.global_rank}.json", info)


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
