"""Fit the tiny workload with ``Elastic`` under torchrun; log every sample each rank trains on.

torchrun --standalone --nproc-per-node=2 --max-restarts=1 tests/scripts/elastic_run.py --out DIR \\
    [--kill-rank 1 --kill-step 7]

Each worker process appends ``{"step", "samples", "rank", "world", "attempt", "incarnation"}`` lines
to ``samples.pid<pid>.jsonl`` (flushed per batch, so a killed worker's lines survive); the
incarnation (rank 0's start time, broadcast) orders the runs of one step, so the last run of every
step is known even when agents and ranks come and go. ``--step-sleep`` slows every step (so a test can
act between steps); ``--hold-alone-from S`` makes a run at world size 1 wait before step S until its
agent stops it (SIGTERM: a node joined), so a test that adds a node finds the run still going. With ``--kill-rank``/``--kill-step`` that
rank SIGKILLs itself after that optimizer step on the first attempt only (on every attempt with
``ELASTIC_RUN_KILL_EVERY_ATTEMPT=1``); ``--fault raise`` raises a RuntimeError there instead, and
``--fault commit`` SIGKILLs rank 0 halfway through writing the commit of that step (leaving a
half-written temporary file and a ``crashed_in_commit`` marker). ``--diloco H`` trains with
``ElasticDiLoCo(inner_steps=H)`` instead (``--compression``: DiLoCo's; ``--diloco-fragments P``:
Streaming DiLoCo with P fragments, ``fragment_sync_delay=1``, ``fragment_update_alpha=0.5``). Rank 0 saves the final
weights and facts (``rank0.pt``, ``rank0.json``); with ``--diloco`` every rank saves its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from rank_io import save_fitted
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_dist import Elastic, ElasticDiLoCo, collectives
from lightning_dist.elastic import commits
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


class Indexed(Dataset):
    """The workload's windows, each with its index."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        x, y = self.inner[i]
        return x, y, i


class Logged(TinyCausalLM):
    def __init__(
        self,
        out: str,
        kill_rank: int,
        kill_step: int,
        step_sleep: float = 0.0,
        fault: str = "kill",
        hold_alone_from: int = -1,
    ) -> None:
        super().__init__(WorkloadConfig.tiny(seed=7))
        self.out, self.kill_rank, self.kill_step, self.fault = out, kill_rank, kill_step, fault
        self.step_sleep, self.hold_alone_from = step_sleep, hold_alone_from
        self.stopped = threading.Event()
        if hold_alone_from >= 0:  # Lightning's own SIGTERM handlers run this one too
            signal.signal(signal.SIGTERM, lambda signum, frame: self.stopped.set())
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.incarnation = 0

    def on_train_start(self) -> None:
        self.incarnation = int(self.trainer.strategy.broadcast(time.time_ns(), 0))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indexed(super().train_dataloader().dataset), batch_size=self.config.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, idx = batch
        if self.trainer.world_size == 1 and 0 <= self.hold_alone_from <= self.trainer.global_step:
            while not self.stopped.wait(0.1):  # until the agent restarts the workers on a larger world
                pass
        entry = {
            "step": self.trainer.global_step,
            "samples": idx.tolist(),
            "rank": self.global_rank,
            "world": self.trainer.world_size,
            "attempt": self.attempt,
            "incarnation": self.incarnation,
        }
        with open(os.path.join(self.out, f"samples.pid{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return super().training_step((x, y), batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        first_attempt = self.attempt == 0 or os.environ.get("ELASTIC_RUN_KILL_EVERY_ATTEMPT") == "1"
        if first_attempt and self.global_rank == self.kill_rank and step == self.kill_step:
            if self.fault == "raise":
                raise RuntimeError(f"injected fault on rank {self.global_rank} after step {step}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)


def crash_while_writing(out: str, step: int) -> None:
    """Make rank 0 die by SIGKILL halfway through writing the commit of ``step`` (first attempt)."""
    write = commits._write_commit

    def half_then_die(temp: Path, state: dict[str, Any]) -> None:
        if f"{step:08d}" not in temp.name:
            return write(temp, state)
        write(temp, state)
        size = temp.stat().st_size
        with open(temp, "r+b") as fh:
            fh.truncate(size // 2)
        Path(out, "crashed_in_commit").write_text(f"{temp.name} cut to {size // 2} of {size} bytes")
        os.kill(os.getpid(), signal.SIGKILL)

    commits._write_commit = half_then_die


def fit(
    out: str,
    *,
    commit_every: int = 3,
    max_steps: int = 12,
    kill_rank: int = -1,
    kill_step: int = -1,
    compression: Optional[str] = None,
    reduce_op: str = "avg",
    step_sleep: float = 0.0,
    fault: str = "kill",
    hold_alone_from: int = -1,
    scale_lr: bool = True,
    accelerator: str = "cpu",
    diloco: int = 0,
    diloco_fragments: int = 1,
) -> tuple[L.Trainer, Logged, Union[Elastic, ElasticDiLoCo]]:
    """One worker's fit with ``Elastic`` (the launcher, torchrun or ``run_elastic``, starts it)."""
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    L.seed_everything(7, verbose=False)
    model = Logged(out, kill_rank, kill_step, step_sleep, fault, hold_alone_from)
    if fault == "commit" and model.attempt == 0 and int(os.environ.get("RANK", "0")) == 0:
        crash_while_writing(out, kill_step)
    common: dict[str, Any] = dict(
        commit_every=commit_every,
        dirpath=os.path.join(out, "commits"),
        compression=compression,
        scale_lr=scale_lr,
    )
    if diloco_fragments > 1:  # Streaming DiLoCo: overlapped by one step, mixed half-half
        common.update(fragments=diloco_fragments, fragment_sync_delay=1, fragment_update_alpha=0.5)
    strategy: Union[Elastic, ElasticDiLoCo] = (
        ElasticDiLoCo(inner_steps=diloco, **common)
        if diloco
        else Elastic(reduce_op=reduce_op, warmup=0, **common)
    )
    trainer = quiet_trainer(
        accelerator=accelerator,
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=max_steps,
        limit_val_batches=0,
        deterministic=True,
    )
    trainer.fit(model)
    return trainer, model, strategy


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--compression", default=None)
    p.add_argument("--reduce-op", default="avg")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--fault", choices=["kill", "raise", "commit"], default="kill")
    p.add_argument("--hold-alone-from", type=int, default=-1)
    p.add_argument("--no-scale-lr", dest="scale_lr", action="store_false")
    p.add_argument("--accelerator", default="cpu", help="gpu: one CUDA device per worker, NCCL")
    p.add_argument("--diloco", type=int, default=0, help="H > 0: ElasticDiLoCo(inner_steps=H)")
    p.add_argument(
        "--diloco-fragments", type=int, default=1, help="P > 1: Streaming DiLoCo, tau=1, alpha=0.5"
    )
    a = p.parse_args(argv)
    options = dict(vars(a))
    trainer, model, strategy = fit(options.pop("out"), **options)  # the flags are fit's keywords
    if trainer.global_rank == 0 or a.diloco:
        save_fitted(
            a.out,
            trainer,
            model,
            resumed_from=strategy.resumed_from,
            attempt=model.attempt,
            lr=trainer.optimizers[0].param_groups[0]["lr"],
            lr_factor=strategy.lr_factor,
            syncs=getattr(strategy, "syncs", None),
            inner_step=getattr(strategy, "inner_step", None),
        )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
