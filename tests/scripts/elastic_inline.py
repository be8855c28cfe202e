"""Train the tiny workload with ``Elastic`` through ``lightning_dist.launch.run_elastic`` (no torchrun):
the agent runs inside this script and restarts the workers itself.

python tests/scripts/elastic_inline.py --out DIR [--kill-step 5]

Each worker runs ``elastic_run.fit`` (commits every 3 steps, 9 steps); rank 1 SIGKILLs itself after
``--kill-step`` on the first attempt. Writes ``DIR/results.json``: each rank's attempt, resumed commit,
final step and the float64 sum of its final weights.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from elastic_run import fit

from lightning_dist import collectives
from lightning_dist.launch import run_elastic


def worker(out: str, kill_step: int) -> dict[str, Any]:
    trainer, model, strategy = fit(out, max_steps=9, kill_rank=1, kill_step=kill_step)
    weights = float(sum(p.detach().double().sum() for p in model.parameters()))
    collectives.shutdown()
    return {"attempt": model.attempt, "resumed_from": strategy.resumed_from, "step": trainer.global_step,
            "weights": weights}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-step", type=int, default=-1)
    a = p.parse_args(argv)
    results = run_elastic(worker, 2, max_restarts=1, args=(a.out, a.kill_step))
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump({str(rank): value for rank, value in results.items()}, fh)


if __name__ == "__main__":
    main()
