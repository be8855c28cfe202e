"""Fit the tiny workload with a Horovod strategy; each rank saves its weights and counters (and,
with ``--record-batches``, the batches it trained on: ``rank<r>.batches.pt``).

horovodrun --mpi -np 2 python tests/scripts/hvd_train.py --strategy horovod_adasum --out DIR
mpirun -np 2 python tests/scripts/hvd_train.py --strategy horovod --accumulate 2 --out DIR
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from rank_io import RecordBatches, save_fitted
from script_setup import parse

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import CommMonitor
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="horovod")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--lr-scale", default="auto")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--record-batches", action="store_true")
    p.add_argument("--out", required=True)
    a = parse(p, argv)
    lr_scale = a.lr_scale if a.lr_scale == "auto" else float(a.lr_scale)
    strategy = {
        "horovod": lambda: lightning_dist.Horovod(lr_scale=lr_scale),
        "horovod_fp16": lambda: lightning_dist.Horovod(compression="fp16", lr_scale=lr_scale),
        "horovod_adasum": lambda: lightning_dist.HorovodAdasum(lr_scale=lr_scale),
    }[a.strategy]()
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(
        WorkloadConfig.tiny(
            seed=7, batch_size=a.batch_size, optimizer=a.optimizer, lr=0.05 if a.optimizer == "sgd" else 3e-3
        )
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate,
        precision=a.precision,  # type: ignore[arg-type]
        gradient_clip_val=a.clip,
        limit_val_batches=2,
        val_check_interval=a.max_steps * a.accumulate,
        deterministic=True,
    )
    tracker, recorder = CommMonitor(log=False), RecordBatches()
    trainer.callbacks.extend([tracker, recorder] if a.record_batches else [tracker])
    trainer.fit(model)
    save_fitted(
        a.out,
        trainer,
        model,
        losses=tracker.losses,
        val_acc=float(trainer.callback_metrics.get("val_acc", torch.tensor(float("nan")))),
        lr_scale=strategy.applied_lr_scale,
        stats=trainer.strategy.communicator.stats.snapshot(),
    )
    if a.record_batches:
        torch.save(recorder.batches, f"{a.out}/rank{trainer.global_rank}.batches.pt")


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
