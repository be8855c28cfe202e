"""Train the tiny workload with ``Elastic`` through ``lightning_dist.launch.run_elastic`` (no torchrun):
the agent runs inside this script and restarts the workers itself.

python tests/scripts/elastic_inline.py --out DIR [--kill-step 5]

Rank 1 SIGKILLs itself after ``--kill-step`` on the first attempt. Writes ``DIR/results.json``: each
rank's attempt, resumed commit, final step and the float64 sum of its final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

from lightning_dist.launch import run_elastic


def train(out: str, kill_step: int) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_dist import Elastic, collectives
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class KilledOnce(TinyCausalLM):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if attempt == 0 and self.global_rank == 1 and self.trainer.global_step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)

    L.seed_everything(7, verbose=False)
    model = KilledOnce(WorkloadConfig.tiny(seed=7))
    strategy = Elastic(commit_every=3, dirpath=os.path.join(out, "commits"))
    trainer = quiet_trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=9, limit_val_batches=0)
    trainer.fit(model)
    weights = float(sum(p.detach().double().sum() for p in model.parameters()))
    result = {"attempt": attempt, "resumed_from": strategy.resumed_from, "step": trainer.global_step}
    collectives.shutdown()
    return {**result, "weights": weights}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-step", type=int, default=-1)
    a = p.parse_args()
    results = run_elastic(train, 2, max_restarts=1, args=(a.out, a.kill_step))
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump({str(rank): value for rank, value in results.items()}, fh)


if __name__ == "__main__":
    main()
