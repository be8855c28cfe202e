"""Adasum vs Average: validation loss after the same number of samples, 2 ranks x 4 accumulation steps.

    python benchmarks/bench_adasum_convergence.py [--steps 60]

Runs Horovod() and HorovodAdasum() (mpirun -np 2, MPI controller) and lightning_dist's
DDP(reduce_op="adasum") / DDP() (2 processes, Gloo) on the embedded workload with
accumulate_grad_batches=4, same seed and data, and prints the final validation loss of each.
Learning rates follow each strategy's default scaling (Average: x world size; Adasum on CPU: x1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

MPIRUN = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
RUNS = [
    ("Horovod() average", MPIRUN, "horovod", 1),
    ("HorovodAdasum()", MPIRUN, "horovod_adasum", 1),
    ("DDP() average", [], "ld_ddp", 2),
    ("DDP(reduce_op='adasum')", [], "ld_ddp_adasum", 2),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--accumulate", type=int, default=4)
    a = p.parse_args()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, launcher, strategy, devices in RUNS:
            out = os.path.join(tmp, f"{strategy}.json")
            cmd = [*launcher, sys.executable, "-m", "lightning_dist.workload.train", "--strategy", strategy]
            cmd += ["--devices", str(devices), "--max-steps", str(a.steps), "--accumulate", str(a.accumulate)]
            cmd += ["--json-out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(f"{label}: failed\n{proc.stderr[-2000:]}")
                continue
            with open(out) as fh:
                r = json.load(fh)["result"]
            rows.append((label, r))
            print(f"{label}: val loss {r['final_val_loss']:.4f}", flush=True)
    samples = a.steps * a.accumulate * 2 * 16
    print()
    print(
        f"machine: {platform.machine()}, torch {torch.__version__}; {a.steps} optimizer steps x {a.accumulate} "
        f"accumulation x 2 ranks x 16 sequences = {samples} samples of 128 bytes"
    )
    print(
        f"command: python benchmarks/bench_adasum_convergence.py --steps {a.steps} --accumulate {a.accumulate}"
    )
    print("| strategy | final val loss | final train loss | median step |\n|---|---|---|---|")
    for label, r in rows:
        print(
            f"| {label} | {r['final_val_loss']:.4f} | {r['final_train_loss']:.4f} | {r['median_step_s'] * 1e3:.0f} ms |"
        )


if __name__ == "__main__":
    main()
