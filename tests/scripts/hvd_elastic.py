"""Fit the tiny workload with ``HorovodElastic`` under ``horovodrun`` (elastic, Gloo); log every
sample each rank trains on, and change the discovery script's host list at given steps.

horovodrun -np 2 --min-np 1 --max-np 2 --network-interface lo \\
    --host-discovery-script DIR/discover.sh python tests/scripts/hvd_elastic.py --out DIR \\
    [--hosts-file DIR/hosts --set-hosts 3:2:localhost:1 --set-hosts 8:1:localhost:1,127.0.0.1:1]

``--set-hosts STEP:WORLD:HOSTS``: after the first optimizer step >= STEP at world size WORLD (and
after the changes listed before it), rank 0 writes HOSTS (``host:slots`` entries, comma-separated) to ``--hosts-file``, one a line: what the
discovery script prints. ``--kill-rank R --kill-step S``: rank R SIGKILLs itself after its first
step >= S, once per run. Sample lines go to
``samples.pid<pid>.jsonl`` as tests/scripts/elastic_run.py writes them (every fit attempt is a new
incarnation). Rank 0 saves its final weights and facts (``rank0.pt``, ``rank0.json``). ``--plain``
fits once without the elastic engine (``python tests/scripts/hvd_elastic.py --plain --accumulate 2``:
one process reading the global batch of two ranks, a fault-free reference).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from elastic_run import Logged
from rank_io import save_fitted

from lightning_dist.launch.horovod_elastic import fit_horovod_elastic
from lightning_dist.strategies.horovod_elastic import HorovodElastic
from lightning_dist.workload.trainer import quiet_trainer


class HostChanges(L.Callback):
    """Rank 0 rewrites the hosts file once per listed change, in order, after the first step at or
    past its step at its world size. How many are done is kept beside the hosts file: the process
    that is rank 0 may change (the removed host may be rank 0's)."""

    def __init__(self, path: str, changes: list[tuple[int, int, str]]) -> None:
        self.path, self.changes, self.done = path, changes, Path(path + ".done")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        done = int(self.done.read_text()) if self.done.exists() else 0
        if trainer.global_rank != 0 or done == len(self.changes):
            return
        step, world, line = self.changes[done]
        if trainer.global_step >= step and trainer.world_size == world:
            with open(self.path, "w") as fh:
                fh.write("".join(host + "\n" for host in line.split(",")))
            self.done.write_text(str(done + 1))


class KillOnce(L.Callback):
    """Rank ``rank`` SIGKILLs itself after its first optimizer step >= ``step``, once per run (a
    marker file): in whichever process holds that rank then."""

    def __init__(self, out: str, rank: int, step: int) -> None:
        self.marker, self.rank, self.step = os.path.join(out, "killed"), rank, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        due = trainer.global_rank == self.rank and trainer.global_step >= self.step
        if due and not os.path.exists(self.marker):
            with open(self.marker, "w") as fh:
                fh.write(f"pid {os.getpid()} after step {trainer.global_step}")
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hosts-file", default="")
    p.add_argument("--plain", action="store_true", help="one fit, no elastic engine (a reference run)")
    p.add_argument("--accumulate", type=int, default=1, help="the Trainer's accumulate_grad_batches")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--set-hosts", action="append", default=[], help="STEP:WORLD:HOST:SLOTS[,HOST:SLOTS...]")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    changes = [(int(s), int(w), line) for s, w, line in (c.split(":", 2) for c in a.set_hosts)]
    L.seed_everything(7, verbose=False)
    model = Logged(a.out, -1, -1, a.step_sleep)

    def make_trainer() -> L.Trainer:
        return quiet_trainer(
            accelerator="cpu",
            devices=1,
            strategy=HorovodElastic(commit_every=1, dirpath=os.path.join(a.out, "commits")),
            max_steps=a.max_steps,
            limit_val_batches=0,
            deterministic=True,
            accumulate_grad_batches=a.accumulate,
            callbacks=[HostChanges(a.hosts_file, changes), KillOnce(a.out, a.kill_rank, a.kill_step)],
        )

    if a.plain:
        trainer = make_trainer()
        trainer.fit(model)
    else:
        trainer = fit_horovod_elastic(make_trainer, model)
    strategy = trainer.strategy
    assert isinstance(strategy, HorovodElastic)
    resets = 0 if strategy.elastic_state is None else strategy.elastic_state.resets
    if trainer.global_rank == 0:
        save_fitted(a.out, trainer, model, resumed_from=strategy.resumed_from, resets=resets)


if __name__ == "__main__":
    main()
