"""Fit the tiny workload with ``DDP()`` or ``Compressed("powersgd")``; each rank saves its final weights
and, on a node of an emulated cluster, the bytes its veth received during the fit.

One host:       python tests/scripts/netns_train.py --strategy DDP --devices 2 --out DIR
Two nodes:      (in each namespace, with MASTER_ADDR, MASTER_PORT, NODE_RANK, GLOO_SOCKET_IFNAME)
                python tests/scripts/netns_train.py --strategy DDP --devices 1 --num-nodes 2 --out DIR
"""

from __future__ import annotations

import argparse
import os

import lightning as L
from rank_io import parse, save_fitted

import lightning_dist
from lightning_dist import collectives
from lightning_dist.workload import TinyCausalLM, WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer


def received_bytes(ifname: str | None) -> int | None:
    """Bytes received so far on ``ifname`` in this network namespace (/proc/net/dev is per namespace),
    headers included; None without an interface."""
    if not ifname:
        return None
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, counters = line.partition(":")
            if name.strip() == ifname:
                return int(counters.split()[0])
    raise ValueError(f"GLOO_SOCKET_IFNAME={ifname!r} is not an interface of this network namespace")


STRATEGIES = {
    "DDP": lambda: lightning_dist.DDP(),
    "powersgd": lambda: lightning_dist.Compressed("powersgd", warmup=0),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="DDP")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=6)
    a = parse(p, argv)
    L.seed_everything(7, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=7))
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=a.devices,
        num_nodes=a.num_nodes,
        strategy=STRATEGIES[a.strategy](),
        max_steps=a.max_steps,
        limit_val_batches=0,
        deterministic=True,
    )
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    before = received_bytes(ifname)
    trainer.fit(model)
    after = received_bytes(ifname)
    save_fitted(
        a.out,
        trainer,
        model,
        node_rank=trainer.node_rank,
        master_addr=os.environ.get("MASTER_ADDR"),
        gloo_ifname=ifname,
        veth_received=None if before is None or after is None else after - before,
        train_loss=float(trainer.callback_metrics["train_loss"]),
    )


if __name__ == "__main__":
    main()
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
