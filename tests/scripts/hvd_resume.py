"""Fit the tiny workload with HorovodAdasum in a way a resume from a checkpoint can continue exactly.

mpirun -np 2 python tests/scripts/hvd_resume.py --max-steps 8 --out DIR                     # uninterrupted
mpirun -np 2 python tests/scripts/hvd_resume.py --max-steps 4 --save CKPT --out DIR1        # first half
mpirun -np 2 python tests/scripts/hvd_resume.py --max-steps 8 --resume CKPT --out DIR2      # resumed

An epoch is exactly ``STEPS_PER_EPOCH`` steps over a fixed, unshuffled per-rank list of batches (no
DistributedSampler), so a checkpoint taken at a multiple of it resumes with the same data order.
``--save`` writes ``trainer.save_checkpoint`` (on every rank, as ``ModelCheckpoint`` does) after ``fit``;
``--save-every N`` adds a ``ModelCheckpoint`` saving ``DIR/epoch=E-step=S.ckpt`` every N steps during ``fit``.
Every rank saves its weights (``rank{r}.pt``/``rank{r}.json``) and its optimizer's state
(``rank{r}_opt.pt``); the json also lists the warnings ``fit`` raised.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rank_io import save_fitted
from script_setup import cpu_trainer, parse
from torch.utils.data import DataLoader, Subset

import lightning_dist
from lightning_dist import collectives
from lightning_dist.workload import TinyCausalLM, WorkloadConfig

STEPS_PER_EPOCH = 4


class FixedOrder(TinyCausalLM):
    seen_batches: list[Any] = []

    def train_dataloader(self) -> DataLoader:
        data = super().train_dataloader().dataset
        world, rank, size = self.trainer.world_size, self.global_rank, self.config.batch_size
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(7)).tolist()
        idx = [order[(s * world + rank) * size + j] for s in range(STEPS_PER_EPOCH) for j in range(size)]
        return DataLoader(Subset(data, idx), batch_size=size, shuffle=False, drop_last=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # (step, epoch, batch index, the batch's first token ids): the data order, for the test to compare
        seen = (self.trainer.global_step, self.current_epoch, batch_idx, batch[0][:, 0].tolist())
        self.seen_batches.append(seen)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save", default=None)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", required=True)
    a = parse(p, argv)
    torch.manual_seed(7)
    model = FixedOrder(WorkloadConfig.tiny(seed=7))
    strategy = lightning_dist.HorovodAdasum()
    trainer = cpu_trainer(
        1,
        strategy,
        a.max_steps,
        use_distributed_sampler=False,
        **(
            {
                "enable_checkpointing": True,
                "callbacks": [
                    ModelCheckpoint(dirpath=a.out, every_n_train_steps=a.save_every, save_top_k=-1)
                ],
            }
            if a.save_every
            else {}
        ),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=a.resume)
    if a.save:
        trainer.save_checkpoint(a.save)
    optimizer = trainer.optimizers[0]
    state = {str(i): {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
    os.makedirs(a.out, exist_ok=True)
    torch.save(state, os.path.join(a.out, f"rank{trainer.global_rank}_opt.pt"))
    save_fitted(
        a.out,
        trainer,
        model,
        batches=model.seen_batches,
        warnings=[str(w.message) for w in caught if "HorovodAdasum" in str(w.message)],
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
