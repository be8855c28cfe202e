"""Two-rank fits of the tiny workload with a ``Timeline`` for the straggler and failure-trace tests.

python tests/scripts/straggler_run.py --mode straggler --out DIR   # rank 1 sleeps before each backward
python tests/scripts/straggler_run.py --mode raise --fail-step 2 --out DIR   # both ranks raise there
python tests/scripts/straggler_run.py --mode sigterm --out DIR     # trains until the test sends SIGTERM

Files in DIR: the Timeline's (``timeline.json`` after a fit that ends, ``timeline-attempt-<n>.json``
after one that fails), ``rank{r}.pid``, and ``rank{r}.json``: the rank's facts (straggler: the
report, the logged ``comm/wait_s`` and ``comm/straggler_rank``; raise: the exception's type).
sigterm: rank 0 writes ``started`` once two steps are done.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any

import lightning as L
from rank_io import parse

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import CommMonitor, Timeline
from lightning_dist.callbacks.monitor import STRAGGLER_RANK, WAIT_SECONDS
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

SLEEP_S = 0.2
INTERVAL = 2


class Unlogged(TinyCausalLM):
    """The tiny workload without its ``sync_dist`` loss log: the gradient all-reduce is the one
    collective of a step. ``fail_step``: raise in ``training_step`` at that optimizer step."""

    def __init__(self, fail_step: int = -1) -> None:
        super().__init__(WorkloadConfig.tiny(seed=7))
        self.fail_step = fail_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.global_step == self.fail_step:
            raise RuntimeError(f"injected failure at step {self.fail_step}")
        loss, _ = self._loss(batch)
        return loss


class Pace(L.Callback):
    """Rank ``rank`` sleeps ``before_backward`` seconds before each backward; every rank sleeps
    ``after_batch`` after each batch; rank 0 writes ``started`` after step 2."""

    def __init__(
        self, out: str, rank: int = 1, before_backward: float = 0.0, after_batch: float = 0.0
    ) -> None:
        self.out, self.rank, self.before_backward, self.after_batch = out, rank, before_backward, after_batch

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: Any) -> None:
        if trainer.global_rank == self.rank and self.before_backward:
            time.sleep(self.before_backward)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        if self.after_batch:
            time.sleep(self.after_batch)
        if trainer.global_rank == 0 and trainer.global_step == 2:
            open(os.path.join(self.out, "started"), "w").close()


def _save(out: str, rank: int, info: dict[str, Any]) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(info, fh)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["straggler", "raise", "sigterm"], default="straggler")
    p.add_argument("--fail-step", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=6)
    a = parse(p, argv)
    os.makedirs(a.out, exist_ok=True)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    with open(os.path.join(a.out, f"rank{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    L.seed_everything(7, verbose=False)
    model = Unlogged(a.fail_step if a.mode == "raise" else -1)
    timeline = Timeline(os.path.join(a.out, "timeline.json"))
    monitor = CommMonitor(stragglers=INTERVAL, log=False)
    pace = Pace(a.out, before_backward=SLEEP_S if a.mode == "straggler" else 0.0,
                after_batch=0.1 if a.mode == "sigterm" else 0.0)  # fmt: skip
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_dist.DDP(timeout=timedelta(seconds=60)),
        max_steps=1000 if a.mode == "sigterm" else a.max_steps,
        limit_val_batches=0,
        callbacks=[timeline, monitor, pace],
    )
    try:
        trainer.fit(model)
    except BaseException as exc:
        _save(
            a.out,
            trainer.global_rank,
            {"error": type(exc).__name__, "failure_path": str(timeline.failure_path)},
        )
        if a.mode != "raise":
            raise
        return
    report = monitor.straggler_report
    assert report is not None
    _save(
        a.out,
        trainer.global_rank,
        {
            "global_step": trainer.global_step,
            "interval": INTERVAL,
            "report": {"calls": report.calls, "last_count": report.last_count, "wait_ns": report.wait_ns},
            "table": report.table(),
            "wait_s_logged": [h[WAIT_SECONDS] for h in monitor.history if WAIT_SECONDS in h],
            "straggler_logged": [h[STRAGGLER_RANK] for h in monitor.history if STRAGGLER_RANK in h],
        },
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
