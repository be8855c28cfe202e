"""Run under ``mpirun -np N``: compares lightning_dist's Adasum (over a Gloo group in the same
processes) with Horovod's MPI Adasum on the same random per-rank tensors, and checks the
HorovodBackend collectives against expected values. Each rank writes ``$HVD_CHECK_OUT/rank<r>.json``.

    HVD_CHECK_OUT=/tmp mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \\
        -x HVD_CHECK_OUT python tests/scripts/hvd_check.py

The Gloo group meets at a store on a port the OS picks (``init_gloo_beside_horovod``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist.collectives import Communicator, TorchBackend
from lightning_dist.collectives import horovod_backend as hvd_backend
from lightning_dist.collectives.adasum import adasum_reference
from lightning_dist.collectives.horovod_backend import HorovodBackend, import_horovod
from lightning_dist.launch.horovod_run import init_gloo_beside_horovod

SHAPES = [(1000,), (37, 11), (3, 4, 5), (1,), (257,)]


def rank_tensors(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s inputs: several shapes, plus one tensor small enough to hit the zero-norm guard."""
    gen = torch.Generator().manual_seed(4321 + rank)
    ts = [torch.randn(s, generator=gen) for s in SHAPES]
    ts.append(torch.randn(10, generator=gen) * 1e-7)
    return ts


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_adasum(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    ours = rank_tensors(rank)
    Communicator(TorchBackend()).all_reduce(ours, op="adasum")

    theirs = rank_tensors(rank)
    handles = [hvd.allreduce_async_(t, op=hvd.Adasum) for t in theirs]
    for h in handles:
        hvd.synchronize(h)

    native = rank_tensors(rank)
    Communicator(HorovodBackend()).all_reduce(native, op="adasum")

    reference = adasum_reference([rank_tensors(r) for r in range(size)])
    return {
        "ours_vs_horovod": max(rel_err(a, b) for a, b in zip(ours, theirs, strict=True)),
        "native_vs_horovod": max(rel_err(a, b) for a, b in zip(native, theirs, strict=True)),
        "ours_vs_reference": max(rel_err(a, b) for a, b in zip(ours, reference, strict=True)),
        "horovod_vs_reference": max(rel_err(a, b) for a, b in zip(theirs, reference, strict=True)),
    }


def check_backend(rank: int, size: int) -> dict[str, bool]:
    comm = Communicator(HorovodBackend())
    base = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(size)]
    stacked = torch.stack(base)
    checks: dict[str, Callable[[], bool]] = {}

    def reduce(op: str, expected: torch.Tensor) -> bool:
        t = base[rank].clone()
        out = comm.all_reduce(t, op)
        return out is t and torch.allclose(t, expected)

    checks["all_reduce_sum"] = lambda: reduce("sum", stacked.sum(0))
    checks["all_reduce_avg"] = lambda: reduce("avg", stacked.mean(0))
    checks["all_reduce_min"] = lambda: reduce("min", stacked.min(0).values)
    checks["all_reduce_max"] = lambda: reduce("max", stacked.max(0).values)
    checks["all_reduce_list"] = lambda: all(
        torch.allclose(x, stacked.sum(0) * k)
        for k, x in enumerate(comm.all_reduce([base[rank] * k for k in range(3)], "sum"))
    )
    checks["all_reduce_async"] = lambda: torch.allclose(
        comm.all_reduce_async(base[rank].clone(), "sum").wait(), stacked.sum(0)
    )

    def reduce_bf16(op: str, gather_max_world: int) -> bool:
        """bf16 (which Horovod cannot reduce): exact float32 reduction in rank order, in place,
        counted as the gather's (W - 1) N bytes, or as a float32 ring beyond the gather limit."""
        limit = hvd_backend.BF16_GATHER_MAX_WORLD
        hvd_backend.BF16_GATHER_MAX_WORLD = gather_max_world
        try:
            words = [(base[r] / 7).bfloat16() for r in range(size)]
            wide = torch.stack(words).float()
            total = {"sum": wide.sum(0), "avg": wide.sum(0) / size, "max": wide.amax(0)}[op]
            t = words[rank].clone()
            before = comm.stats.snapshot().get("all_reduce.bytes_sent", 0)
            out = comm.all_reduce(t, op)
            sent = comm.stats.snapshot()["all_reduce.bytes_sent"] - before
        finally:
            hvd_backend.BF16_GATHER_MAX_WORLD = limit
        n = t.numel() * 2
        if size <= gather_max_world:
            return out is t and torch.equal(t, total.bfloat16()) and sent == (size - 1) * n
        ring = 2 * (size - 1) * (2 * n) // size
        return out is t and torch.allclose(t.float(), total, rtol=1e-2) and sent == ring

    checks["all_reduce_bf16_sum"] = lambda: reduce_bf16("sum", 4)
    checks["all_reduce_bf16_avg"] = lambda: reduce_bf16("avg", 4)
    checks["all_reduce_bf16_max"] = lambda: reduce_bf16("max", 4)
    checks["all_reduce_bf16_as_fp32"] = lambda: reduce_bf16("avg", 1)

    def broadcast() -> bool:
        t = base[rank].clone()
        comm.broadcast(t, src=size - 1)
        return torch.equal(t, base[size - 1])

    checks["broadcast"] = broadcast
    checks["broadcast_object"] = lambda: (
        comm.broadcast_object({"from": rank, "x": [1, 2]}, src=1)
        == {
            "from": 1,
            "x": [1, 2],
        }
    )

    def gather_unequal() -> bool:
        got = comm.all_gather(torch.full((rank + 1, 2), float(rank)))
        return all(torch.equal(g, torch.full((j + 1, 2), float(j))) for j, g in enumerate(got))

    checks["all_gather_unequal"] = gather_unequal

    def gather_then_reduce() -> bool:
        """An unequal gather exchanges shapes first, on the calling thread, between an all-reduce
        posted before it and one posted after it: every rank posts the four in call order."""
        before = comm.all_reduce_async(torch.ones(3), "sum")
        got = comm.all_gather(torch.full((rank + 1, 2), float(rank)))
        after = comm.all_reduce_async(torch.full((2,), 2.0), "sum")
        return (
            torch.equal(before.wait(), torch.full((3,), float(size)))
            and torch.equal(after.wait(), torch.full((2,), 2.0 * size))
            and all(torch.equal(g, torch.full((j + 1, 2), float(j))) for j, g in enumerate(got))
        )

    checks["all_gather_then_all_reduce"] = gather_then_reduce
    checks["all_gather_same_shape"] = lambda: all(
        torch.equal(g, base[j]) for j, g in enumerate(comm.all_gather(base[rank], same_shape=True))
    )

    def reduce_scatter(op: str) -> bool:
        full = torch.stack([torch.arange(size * 2.0) + r for r in range(size)])
        expected = {"sum": full.sum(0), "avg": full.mean(0), "max": full.max(0).values}[op]
        out = comm.reduce_scatter(full[rank].clone(), op)
        return torch.allclose(out, expected.chunk(size)[rank])

    checks["reduce_scatter_sum"] = lambda: reduce_scatter("sum")
    checks["reduce_scatter_avg"] = lambda: reduce_scatter("avg")
    checks["reduce_scatter_max"] = lambda: reduce_scatter("max")

    def all_to_all() -> bool:
        def chunk(src: int, dst: int) -> torch.Tensor:
            return torch.full((src + dst + 1, 2), float(10 * src + dst))

        got = comm.all_to_all([chunk(rank, j) for j in range(size)])
        return all(torch.equal(g, chunk(j, rank)) for j, g in enumerate(got))

    checks["all_to_all_uneven"] = all_to_all

    def barrier() -> bool:
        comm.barrier()
        return True

    checks["barrier"] = barrier

    def send_raises() -> bool:
        try:
            comm.backend.send(torch.zeros(1), (rank + 1) % size)
        except NotImplementedError:
            return True
        return False

    checks["send_not_implemented"] = send_raises
    checks["stats_counted"] = lambda: comm.stats.per_op["all_reduce"].bytes_sent > 0

    results = {}
    for name, fn in checks.items():
        try:
            results[name] = bool(fn())
        except Exception as exc:  # noqa: BLE001  (reported to the test)
            results[name] = False
            print(f"rank {rank}: {name} raised {exc!r}", file=sys.stderr)
    return results


def main() -> None:
    torch.set_num_threads(1)
    hvd = import_horovod()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    init_gloo_beside_horovod(hvd)
    try:
        result = {"rank": rank, "size": size, "adasum": check_adasum(hvd, rank, size)}
        result["backend"] = check_backend(rank, size)
        # one file per rank: mpirun may interleave the ranks' stdout within a line
        with open(os.path.join(os.environ["HVD_CHECK_OUT"], f"rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        hvd.shutdown()


if __name__ == "__main__":
    main()
