"""DDP() vs Lightning's DDPStrategy: same model, data and seed, 2 CPU processes, run alternately.

    python benchmarks/bench_ddp_overhead.py [--rounds 4] [--steps 40]

Prints the median step time of each (over every post-warm-up step of every round) and the ratio
DDP()/DDPStrategy. Target: at most 1.03. Alternating the order each round spreads the noise of a
shared machine over both.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile

import torch

from lightning_dist.workload.demo import DemoRun, run_one

REFERENCE = DemoRun("Lightning DDPStrategy", "ddp")
CANDIDATE = DemoRun("lightning_dist DDP()", "ld_ddp")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    times: dict[str, list[float]] = {REFERENCE.label: [], CANDIDATE.label: []}
    losses: dict[str, list[float]] = {REFERENCE.label: [], CANDIDATE.label: []}
    pair_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(a.rounds):
            order = (REFERENCE, CANDIDATE) if i % 2 == 0 else (CANDIDATE, REFERENCE)
            medians: dict[str, float] = {}
            for run in order:
                result = run_one(run, a.steps, workdir, [])
                if "error" in result:
                    sys.exit(f"{run.label} failed: {result['error']}")
                times[run.label].extend(result["step_seconds"])
                medians[run.label] = statistics.median(result["step_seconds"])
                losses[run.label].append(result["final_val_loss"])
                print(
                    f"round {i}: {run.label:<24} median {statistics.median(result['step_seconds']) * 1e3:.1f} ms"
                )
            pair_ratios.append(medians[CANDIDATE.label] / medians[REFERENCE.label])
    ref = statistics.median(times[REFERENCE.label])
    cand = statistics.median(times[CANDIDATE.label])
    print()
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, Gloo, 2 processes"
    )
    print(f"command: python benchmarks/bench_ddp_overhead.py --rounds {a.rounds} --steps {a.steps}")
    print("| strategy | median step | final val loss |\n|---|---|---|")
    for label in (REFERENCE.label, CANDIDATE.label):
        print(
            f"| {label} | {statistics.median(times[label]) * 1e3:.1f} ms | {statistics.median(losses[label]):.4f} |"
        )
    print(f"ratio DDP()/DDPStrategy (median step time over all steps): {cand / ref:.3f}  (target <= 1.03)")
    pairs = ", ".join(f"{r:.3f}" for r in pair_ratios)
    print(f"median of per-round ratios (back-to-back pairs): {statistics.median(pair_ratios):.3f}  [{pairs}]")


if __name__ == "__main__":
    main()
