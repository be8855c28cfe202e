"""lightning_dist's Adasum (over a Gloo group) against Horovod's MPI Adasum, in the same processes.

    python benchmarks/bench_adasum.py                          # mpirun -np 2, 1/4/16/64 MB
    python benchmarks/bench_adasum.py --sizes-mb 1 4 --reps 5 --tensors 8

Run plainly, it starts itself under ``mpirun`` (as root it adds --allow-run-as-root) and prints the
machine and the command. Per size it times both Adasums on the same fp32 data, plus a plain sum
all-reduce on each transport (Gloo, MPI), rotating which runs first, each call between barriers; a
call's time is the slowest rank's. It prints the medians, the ratio ours / horovod (target <= 1.0)
and the relative difference of the two Adasum results.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from machine_info import machine  # benchmarks/ is on sys.path when a benchmark runs

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2, help="processes (Horovod's Adasum needs a power of two)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64], help="payload per call, MB")
    p.add_argument("--tensors", type=int, default=1, help="split each payload into this many tensors")
    p.add_argument("--reps", type=int, default=10, help="timed calls per implementation and size")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per implementation and size")
    return p.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("bench_adasum: mpirun not found (Debian: apt-get install -y openmpi-bin libopenmpi-dev)")
        return 2
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    cmd = [
        "mpirun", *root, "--oversubscribe", "--bind-to", "none", "-np", str(args.np),
        "-x", "OMP_NUM_THREADS=1",
        "-x", "PYTHONPATH", sys.executable, str(Path(__file__).resolve()), *argv,
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    print(f"command: python benchmarks/bench_adasum.py {' '.join(argv)}".rstrip())
    print(f"runs:    {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=env, cwd=REPO)


def worker(args: argparse.Namespace) -> None:
    import horovod
    import torch
    import torch.distributed as dist

    from lightning_dist.collectives import Communicator, TorchBackend
    from lightning_dist.collectives.horovod_backend import import_horovod
    from lightning_dist.launch.horovod_run import init_gloo_beside_horovod

    hvd = import_horovod()
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    init_gloo_beside_horovod(hvd, timeout=timedelta(seconds=120))
    comm = Communicator(TorchBackend())

    def ours(ts: list[torch.Tensor]) -> None:
        comm.all_reduce(ts, op="adasum")

    def gloo_sum(ts: list[torch.Tensor]) -> None:
        comm.all_reduce(ts, op="sum")

    def horovods(op: Any) -> Callable[[list[torch.Tensor]], None]:
        """Horovod's in-place all-reduce of ``op``: every tensor started, then each waited for."""

        def run(ts: list[torch.Tensor]) -> None:
            handles = [hvd.allreduce_async_(t, op=op) for t in ts]
            for h in handles:
                hvd.synchronize(h)

        return run

    impls = {
        "ours": ours,
        "horovod": horovods(hvd.Adasum),
        "gloo_sum": gloo_sum,
        "horovod_sum": horovods(hvd.Sum),
    }
    if rank == 0:
        print(f"machine: {machine()}")
        print(
            f"torch {torch.__version__}, horovod {horovod.__version__} (MPI controller: {hvd.mpi_enabled()}), "
            f"{size} processes, 1 thread each, fp32, {args.tensors} tensor(s) per call, "
            f"median of {args.reps} (slowest rank per call)"
        )
        print(
            "ours = lightning_dist Adasum over Gloo; horovod = hvd.Adasum over MPI; the sum columns are "
            "plain all-reduces of the same bytes on each transport (a floor for what Adasum moves)"
        )
        print(
            f"{'size':>8} {'ours ms':>9} {'horovod ms':>11} {'ratio':>6} {'rel diff':>9} "
            f"{'gloo sum ms':>12} {'hvd sum ms':>11}",
            flush=True,
        )
    try:
        for mb in args.sizes_mb:
            n = int(mb * (1 << 20)) // 4
            gen = torch.Generator().manual_seed(1234 + rank)
            parts = [n // args.tensors + (1 if i < n % args.tensors else 0) for i in range(args.tensors)]
            data = [torch.randn(k, generator=gen) for k in parts]
            times: dict[str, list[float]] = {name: [] for name in impls}
            outputs: dict[str, list[torch.Tensor]] = {}
            for rep in range(args.warmup + args.reps):
                order = list(impls)[rep % len(impls) :] + list(impls)[: rep % len(impls)]
                for name in order:
                    ts = [t.clone() for t in data]
                    dist.barrier()
                    start = time.perf_counter()
                    impls[name](ts)
                    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if rep >= args.warmup:
                        times[name].append(float(elapsed))
                    outputs[name] = ts
            a = torch.cat([t.double() for t in outputs["ours"]])
            b = torch.cat([t.double() for t in outputs["horovod"]])
            diff = float((a - b).norm() / b.norm())
            t_ours = statistics.median(times["ours"]) * 1e3
            t_hvd = statistics.median(times["horovod"]) * 1e3
            t_gloo = statistics.median(times["gloo_sum"]) * 1e3
            t_hsum = statistics.median(times["horovod_sum"]) * 1e3
            if rank == 0:
                print(
                    f"{mb:>6g}MB {t_ours:>9.2f} {t_hvd:>11.2f} {t_ours / t_hvd:>6.2f} {diff:>9.1e} "
                    f"{t_gloo:>12.2f} {t_hsum:>11.2f}",
                    flush=True,
                )
        dist.barrier()
    finally:
        dist.destroy_process_group()
        hvd.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "HOROVOD_RANK" in os.environ:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
