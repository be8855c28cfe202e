"""Horovod() in Lightning vs a plain Horovod training loop (hvd.DistributedOptimizer), same model/data.

    python benchmarks/bench_horovod_overhead.py [--steps 40] [--rounds 3]

Both run the embedded workload under ``mpirun -np 2`` (MPI controller, one thread per rank), AdamW,
batch 16 x 128 per rank, alternating; prints median step times and the ratio Horovod()/plain loop.
The plain loop is the reference for what Horovod itself costs on this machine. The Lightning run
also does what the plain loop does not: ``self.log("train_loss", sync_dist=True)`` every step (one
more Horovod all-reduce) and Lightning's loop bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

MPIRUN = [
    "mpirun",
    "-np",
    "2",
    "--allow-run-as-root",
    "--oversubscribe",
    "--bind-to",
    "none",
    "-x",
    "OMP_NUM_THREADS",
]


def plain_loop(steps: int, out: str) -> None:
    import horovod.torch as hvd
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.data import TextBlocks, load_corpus

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = TinyCausalLM(WorkloadConfig())
    data = TextBlocks(load_corpus("train", model.config.train_bytes), model.config.seq_len)
    loader = DataLoader(
        data,
        batch_size=model.config.batch_size,
        sampler=DistributedSampler(data, hvd.size(), hvd.rank(), shuffle=True, seed=1234),
        drop_last=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.config.lr * hvd.size(), weight_decay=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    times: list[float] = []
    for i, batch in enumerate(loader):
        if i == steps:
            break
        start = time.perf_counter()
        optimizer.zero_grad()
        loss, _ = model._loss(batch)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        with open(out, "w") as fh:
            json.dump({"step_seconds": times[3:]}, fh)


def run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed\n{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain-loop", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.plain_loop:
        plain_loop(a.steps, a.plain_loop)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    times: dict[str, list[float]] = {"Horovod() strategy": [], "plain hvd.DistributedOptimizer loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            order = list(times) if i % 2 == 0 else list(reversed(times))
            for label in order:
                out = os.path.join(tmp, f"{i}-{len(label)}.json")
                if label.startswith("plain"):
                    run(
                        [*MPIRUN, sys.executable, __file__, "--steps", str(a.steps), "--plain-loop", out], env
                    )
                    with open(out) as fh:
                        times[label].extend(json.load(fh)["step_seconds"])
                else:
                    cmd = [
                        *MPIRUN,
                        sys.executable,
                        "-m",
                        "lightning_dist.workload.train",
                        "--strategy",
                        "horovod",
                    ]
                    run([*cmd, "--devices", "1", "--max-steps", str(a.steps), "--json-out", out], env)
                    with open(out) as fh:
                        times[label].extend(json.load(fh)["result"]["step_seconds"])
                print(
                    f"round {i}: {label}: {statistics.median(times[label]) * 1e3:.1f} ms so far", flush=True
                )
    ours = statistics.median(times["Horovod() strategy"])
    ref = statistics.median(times["plain hvd.DistributedOptimizer loop"])
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores; command: python {' '.join(sys.argv)}")
    print("| run | median step |\n|---|---|")
    for label, ts in times.items():
        print(f"| {label} | {statistics.median(ts) * 1e3:.1f} ms |")
    print(f"ratio Horovod()/plain loop: {ours / ref:.3f}")


if __name__ == "__main__":
    main()
