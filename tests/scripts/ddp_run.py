"""Fit the tiny workload with a strategy and save each rank's final weights and counters.

python tests/scripts/ddp_run.py --strategy ld_ddp --out DIR [--accumulate 2] [--devices 2]
"""

from __future__ import annotations

import argparse

import lightning as L
from rank_io import save_fitted
from script_setup import cpu_trainer, parse

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import CommMonitor
from lightning_dist.workload import TinyCausalLM, WorkloadConfig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ld_ddp")
    p.add_argument("--start-method", default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", required=True)
    a = parse(p, argv)
    strategy: object = a.strategy
    if a.strategy == "DDP":
        strategy = lightning_dist.DDP(start_method=a.start_method or "auto")
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7, batch_size=a.batch_size, lr=a.lr))
    trainer = cpu_trainer(
        a.devices, strategy, a.max_steps, accumulate_grad_batches=a.accumulate, gradient_clip_val=a.clip
    )
    tracker = CommMonitor(log=False)
    trainer.callbacks.append(tracker)
    trainer.fit(model)  # the strategy's communicator, made at setup, counts from zero
    hook_state = getattr(trainer.strategy, "hook_state", None)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    comm = getattr(trainer.strategy, "communicator", None)  # Lightning's "ddp" has none
    snapshot = comm.stats.snapshot() if comm is not None else {}
    save_fitted(
        a.out,
        trainer,
        model,
        hook_calls=getattr(hook_state, "calls", None),
        all_reduce_calls=snapshot.get("all_reduce.calls", 0),
        all_reduce_bytes_sent=snapshot.get("all_reduce.bytes_sent", 0),
        train_loss=float(trainer.callback_metrics["train_loss"]),
        losses=tracker.losses,
        grads=len(grads),
        grad_storages=len({g.untyped_storage().data_ptr() for g in grads}),
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
