"""Fit the tiny workload on two ranks with a short process-group timeout; one rank stops itself
(SIGSTOP) at one step, so the other's next collective must time out.

torchrun --standalone --nproc-per-node=2 --max-restarts=0 \\
    tests/scripts/stopped_rank.py --timeout 5 --stop-rank 1 --stop-step 3 --stop-at training_step --out DIR
python tests/scripts/stopped_rank.py ...   (Lightning's own launcher: rank 0 starts rank 1)

Where the rank stops decides which collective times out on the other rank:
  batch_start    before the step: torch DDP's own broadcast of the model's buffers in its forward
                 (the workload has a causal-mask buffer), which does not go through ``collectives``
  training_step  inside the step, after that broadcast: the ``sync_dist`` all-reduce of the logged
                 loss (``collectives.all_reduce`` through the strategy's ``reduce``)
  backward       before backward: the gradient all-reduce of the DDP comm hook
                 (``collectives.all_reduce_async``, waited on by torch DDP's reducer)

Files in DIR, for the test to read:
  rank{r}.pid      each rank's pid, written at start (the test checks none is left behind)
  stopped.json     the stopping rank: {"rank", "step", "at", "time"} just before it sends itself SIGSTOP
  (--timeline PATH: a Timeline writes its failure trace next to PATH)
  rank{r}.error.json  a rank whose fit raised: {"type", "text", "time"} (``text``: the exception
                   and its causes, as the traceback shows them), then the exception propagates
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback
from datetime import timedelta
from typing import Any

import lightning as L
import torch

import lightning_dist
from lightning_dist import collectives
from lightning_dist.callbacks import Timeline
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


def _write(path: str, payload: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class StopsItself(TinyCausalLM):
    """The tiny workload; rank ``stop_rank`` sends itself SIGSTOP at optimizer step ``stop_step``,
    in ``on_train_batch_start`` or in ``training_step`` (``stop_at``)."""

    def __init__(self, stop_rank: int, stop_step: int, stop_at: str, out: str) -> None:
        super().__init__(WorkloadConfig.tiny(seed=7))
        self.stop_rank, self.stop_step, self.stop_at, self.out = stop_rank, stop_step, stop_at, out

    def _maybe_stop(self, where: str) -> None:
        if (
            where == self.stop_at
            and self.global_rank == self.stop_rank
            and self.trainer.global_step == self.stop_step
        ):
            _write(
                os.path.join(self.out, "stopped.json"),
                {"rank": self.global_rank, "step": self.stop_step, "at": where, "time": time.time()},
            )
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._maybe_stop("batch_start")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._maybe_stop("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: Any) -> None:
        self._maybe_stop("backward")


RENDEZVOUS_S = 120.0
"""Seconds the rendezvous waits for rank 1 to start (the collectives keep the short timeout)."""


class PatientRendezvousDDP(lightning_dist.DDP):
    """``DDP`` whose rendezvous waits ``RENDEZVOUS_S`` for the peer to start; the short timeout is for
    the collectives only. Under Lightning's launcher rank 0 starts rank 1 once it has itself started,
    so rank 1 joins the store seconds after rank 0 (importing torch and Lightning: over 6 s on a
    loaded 2-CPU machine), which the test's 5 s process-group timeout would not allow."""

    def _process_group_kwargs(self) -> dict[str, Any]:
        env = self.cluster_environment
        assert env is not None
        store = torch.distributed.TCPStore(
            env.main_address,
            env.main_port,
            self.world_size,
            is_master=self.global_rank == 0,
            timeout=timedelta(seconds=RENDEZVOUS_S),
        )
        return {"store": store}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=5.0, help="the process-group timeout, seconds")
    p.add_argument("--stop-rank", type=int, default=1)
    p.add_argument("--stop-step", type=int, default=3)
    p.add_argument("--stop-at", choices=["batch_start", "training_step", "backward"], default="training_step")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--out", required=True)
    p.add_argument("--timeline", default=None, help="a Timeline's path (its failure trace lands next to it)")
    a = p.parse_args(argv)
    # torchrun sets RANK; Lightning's launcher starts rank r > 0 with LOCAL_RANK=r (one node)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{rank}.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    model = StopsItself(a.stop_rank, a.stop_step, a.stop_at, a.out)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        # torchrun's agent holds the store and both ranks start together: torch's own rendezvous
        strategy=(lightning_dist.DDP if "TORCHELASTIC_RUN_ID" in os.environ else PatientRendezvousDDP)(
            timeout=timedelta(seconds=a.timeout)
        ),
        max_steps=a.max_steps,
        limit_val_batches=0,
        callbacks=[] if a.timeline is None else [Timeline(a.timeline)],
    )
    try:
        trainer.fit(model)
    except BaseException as exc:
        _write(
            os.path.join(a.out, f"rank{trainer.global_rank}.error.json"),
            {
                "type": type(exc).__name__,
                "text": "".join(traceback.format_exception(exc)),
                "time": time.time(),
            },
        )
        raise


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
