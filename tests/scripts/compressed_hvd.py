"""Fit the tiny workload with ``Horovod(compression=...)``; each rank saves its weights and losses.

mpirun -np 2 python tests/scripts/compressed_hvd.py --compression bf16 --out DIR
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
from rank_io import save_fitted
from script_setup import cpu_trainer, parse

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import CommMonitor
from lightning_dist.compression import make_compressor
from lightning_dist.workload import TinyCausalLM, WorkloadConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compression", default="none", help="a name, or 'instance:<name>' for a Compressor")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--out", required=True)
    a = parse(p, argv)
    compression: Any = a.compression
    if compression.startswith("instance:"):
        compression = make_compressor(compression.split(":", 1)[1])
    strategy = lightning_dist.Horovod(compression=compression)
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7, batch_size=8))
    monitor = CommMonitor(log=False)
    trainer = cpu_trainer(1, strategy, a.max_steps, callbacks=[monitor])
    trainer.fit(model)
    save_fitted(
        a.out, trainer, model, losses=monitor.losses, stats=trainer.strategy.communicator.stats.snapshot()
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
