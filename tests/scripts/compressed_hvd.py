"""Fit the tiny workload with ``Horovod(compression=...)``; each rank saves its weights and losses.

mpirun -np 2 python tests/scripts/compressed_hvd.py --compression bf16 --out DIR
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from rank_io import save_rank

import lightning_dist
from lightning_dist.callbacks import CommMonitor
from lightning_dist.compression import make_compressor
from lightning_dist.workload import TinyCausalLM, WorkloadConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compression", default="none", help="a name, or 'instance:<name>' for a Compressor")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    compression: Any = a.compression
    if compression.startswith("instance:"):
        compression = make_compressor(compression.split(":", 1)[1])
    strategy = lightning_dist.Horovod(compression=compression)
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7, batch_size=8))
    monitor = CommMonitor(log=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=a.max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
        callbacks=[monitor],
    )
    trainer.fit(model)
    rank = trainer.global_rank
    info = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "losses": monitor.losses,
        "stats": lightning_dist.collectives.stats().snapshot(),
    }
    save_rank(a.out, rank, model, info)


if __name__ == "__main__":
    main()
