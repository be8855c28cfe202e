"""GPU check of lightning_dist.collectives: CUDA tensors over NCCL (world size 1) or Gloo (2 ranks on one GPU).

    torchrun --nproc_per_node 2 scripts/gpu_collectives_check.py --backend gloo
    torchrun --nproc_per_node 1 scripts/gpu_collectives_check.py --backend nccl

Every rank checks each collective against values computed locally; prints one PASS/FAIL line per check.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from lightning_dist import collectives
from lightning_dist.collectives.adasum import adasum_reference


def rank_tensor(rank: int, n: int = 1000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    a = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(
        a.backend,
        device_id=torch.device("cuda", torch.cuda.current_device()) if a.backend == "nccl" else None,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    ok = True

    def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
        nonlocal ok
        good = got.device.type == "cuda" and torch.allclose(
            got.cpu().float(), want.cpu().float(), rtol=tol, atol=tol
        )
        ok &= good
        print(f"[rank {rank}/{world} {a.backend}] {'PASS' if good else 'FAIL'} {name}", flush=True)

    everyone = [rank_tensor(r) for r in range(world)]
    t = rank_tensor(rank).to(dev)
    check("all_reduce avg", collectives.all_reduce(t, "avg"), torch.stack(everyone).mean(0))
    t = rank_tensor(rank).to(dev)
    check("all_reduce_async sum", collectives.all_reduce_async(t, "sum").wait(), torch.stack(everyone).sum(0))
    t = rank_tensor(rank).to(dev)
    check("broadcast", collectives.broadcast(t, 0), everyone[0])
    gathered = collectives.all_gather(rank_tensor(rank, 10 + rank).to(dev))
    for r, g in enumerate(gathered):
        check(f"all_gather uneven [{r}]", g, rank_tensor(r, 10 + r))
    obj = collectives.broadcast_object({"from": rank}, 0)
    ok &= obj == {"from": 0}
    grads = [rank_tensor(rank, 300).to(dev), rank_tensor(rank + 50, 77).to(dev).to(torch.bfloat16)]
    want = adasum_reference(
        [[rank_tensor(r, 300), rank_tensor(r + 50, 77).to(torch.bfloat16)] for r in range(world)]
    )
    got = collectives.all_reduce(grads, "adasum")
    check("adasum fp32", got[0], want[0], 1e-4)
    check("adasum bf16", got[1], want[1], 2e-2)
    collectives.barrier()
    print(f"[rank {rank}] stats {collectives.world().stats.snapshot()['bytes_sent']} bytes sent", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
