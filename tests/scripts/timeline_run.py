"""Fit the tiny workload with a strategy and a ``Timeline``; each rank saves its facts.

python tests/scripts/timeline_run.py --strategy ddp --out DIR          # 2 CPU processes (Gloo)
python tests/scripts/timeline_run.py --strategy powersgd --out DIR
mpirun -np 2 python tests/scripts/timeline_run.py --strategy horovod --out DIR

The trace is DIR/timeline.json (written by rank 0); DIR/rank{r}.json has the step count and the
comm hook's bucket calls.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
from rank_io import parse, save_fitted

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import Timeline
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp", choices=["ddp", "powersgd", "horovod"])
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=1)
    a = parse(p, argv)
    strategy = {
        "ddp": lambda: lightning_dist.DDP(),
        "powersgd": lambda: lightning_dist.Compressed("powersgd", warmup=0),
        "horovod": lambda: lightning_dist.Horovod(),
    }[a.strategy]()
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7))
    timeline = Timeline(os.path.join(a.out, "timeline.json"))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1 if a.strategy == "horovod" else 2,
        strategy=strategy,
        max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate,
        limit_val_batches=0,
        callbacks=[timeline],
    )
    trainer.fit(model)
    hook_state = getattr(trainer.strategy, "hook_state", None)
    save_fitted(
        a.out,
        trainer,
        model,
        hook_calls=getattr(hook_state, "calls", None),
        wrote_trace=timeline.trace is not None,
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
