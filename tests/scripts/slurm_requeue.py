"""Fit the tiny workload with a DDP-family strategy in a way a SLURM requeue can resume exactly.

srun --ntasks-per-node 2 python tests/scripts/slurm_requeue.py --out DIR [--step-sleep 0.3]
python tests/scripts/slurm_requeue.py --out DIR          # the same run without SLURM (Lightning's launcher)

The Trainer's ``default_root_dir`` is DIR, so Lightning's SLURM requeue handler (SIGUSR1) saves
``DIR/hpc_ckpt_<n>.ckpt`` and the requeued run resumes from it. The data order is a fixed function of
the step (no DistributedSampler): after a resume from step k, each rank's next batch is the one the
uninterrupted run trained at step k (Lightning restarts a non-resumable loader at the epoch's start).
Rank 0 writes ``progress`` (the last finished step), appends one line per run to ``runs.jsonl``
(SLURM's restart count and the step the run started at) and, at the end, every rank saves its weights
(``rank{r}.pt``/``rank{r}.json``). ``--step-sleep`` sleeps inside ``training_step`` so a test can
signal the job between steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import lightning as L
import torch
from rank_io import cpu_trainer, save_fitted
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from lightning_dist import collectives  # also registers the strategy names
from lightning_dist.workload import TinyCausalLM, WorkloadConfig


class StepOrdered(TinyCausalLM):
    def __init__(self, out: str, step_sleep: float) -> None:
        super().__init__(WorkloadConfig.tiny(seed=7))
        self.out, self.step_sleep = out, step_sleep
        self.skip_steps = 0

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning resumes at this step; the loader below starts there
        self.skip_steps = int(checkpoint["global_step"])

    def train_dataloader(self) -> DataLoader:
        data = super().train_dataloader().dataset
        world, rank, size = self.trainer.world_size, self.global_rank, self.config.batch_size
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(7)).tolist()
        steps = len(order) // (size * world)
        # step s of the epoch trains order[s*size*world + rank*size : ... + size] on this rank; a resumed
        # run starts at its step (the skipped steps come last, so the epoch keeps its length)
        rotated = list(range(self.skip_steps, steps)) + list(range(self.skip_steps))
        idx = [order[s * size * world + rank * size + j] for s in rotated for j in range(size)]
        return DataLoader(Subset(data, idx), batch_size=size, shuffle=False, drop_last=True)

    def on_train_start(self) -> None:
        if self.global_rank == 0:
            run = {
                "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                "start_step": self.trainer.global_step,
            }
            with open(os.path.join(self.out, "runs.jsonl"), "a") as fh:
                fh.write(json.dumps(run) + "\n")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.step_sleep:
            time.sleep(self.step_sleep)  # a signal lands here, between optimizer steps
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 0:
            with open(os.path.join(self.out, "progress.tmp"), "w") as fh:
                fh.write(str(self.trainer.global_step))
            os.replace(os.path.join(self.out, "progress.tmp"), os.path.join(self.out, "progress"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ld_ddp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    model = StepOrdered(a.out, a.step_sleep)
    trainer = cpu_trainer(
        a.devices, a.strategy, a.max_steps, use_distributed_sampler=False, default_root_dir=a.out
    )
    trainer.fit(model)
    save_fitted(a.out, trainer, model, train_loss=float(trainer.callback_metrics["train_loss"]))


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
