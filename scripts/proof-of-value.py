#!/usr/bin/env python
"""Proof of value for refactors: every strategy's numbers, bitwise, before and after a change.

Trains the embedded workload (``WorkloadConfig.tiny``) for a few steps with every registered
strategy family on 2 CPU processes (Lightning's launcher, torchrun for Elastic, mpirun for Horovod)
and records, per rank, every step's loss (exact float), a SHA-256 of the final weights, and the
CommMonitor byte counters. Run it on the commit before a refactor and on the commit after; with
``--compare`` it prints one row per configuration and exits 1 when anything differs.

    python scripts/proof-of-value.py --out /tmp/pov-before.json            # on the old commit
    python scripts/proof-of-value.py --out /tmp/pov-after.json --compare /tmp/pov-before.json

``--only NAME[,NAME]`` runs some configurations. A row's child process runs this file with
``--child`` (Lightning's launcher re-executes it per rank).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = 12
SEED = 7

# name -> (launcher, strategy spec for the child)
CONFIGS: dict[str, tuple[str, str]] = {
    "lightning_ddp": ("lightning", "ddp"),
    "ld_ddp": ("lightning", "ld_ddp"),
    "ld_ddp_adasum": ("lightning", "ld_ddp_adasum"),
    **{
        f"ld_compressed_{c}": ("lightning", f"ld_compressed_{c}")
        for c in ("none", "fp16", "bf16", "int8", "topk", "powersgd", "sign", "demo")
    },
    "ld_diloco": ("lightning", "ld_diloco"),
    "ld_diloco_int8": ("lightning", "ld_diloco_int8"),
    "ld_elastic": ("torchrun", "ld_elastic"),
    "ld_elastic_diloco": ("torchrun", "ld_elastic_diloco"),
    "ld_horovod": ("mpirun", "ld_horovod"),
    "ld_horovod_fp16": ("mpirun", "ld_horovod_fp16"),
    "ld_horovod_adasum": ("mpirun", "ld_horovod_adasum"),
}


def weights_sha256(module: Any) -> str:
    """SHA-256 over every state-dict tensor's name, dtype, shape and bytes, in key order."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def child(spec: str, out: Path) -> None:
    """One rank's training; writes ``out/rank<R>.json``."""
    import lightning as L
    import torch

    import lightning_dist  # noqa: F401  (registers the ld_ names)
    from lightning_dist.callbacks import CommMonitor
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    torch.set_num_threads(1)
    L.seed_everything(SEED, workers=True, verbose=False)
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append(float(outputs["loss"]))

    monitor = CommMonitor(log=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=SEED))
    strategy: Any = spec
    if spec.startswith(("ld_diloco", "ld_elastic")):  # DiLoCo syncs every 4 steps within the run
        from lightning_dist import DiLoCo, Elastic, ElasticDiLoCo

        diloco = {"inner_steps": 4, "compression": "int8" if spec.endswith("int8") else None}
        if spec == "ld_elastic":
            strategy = Elastic(dirpath=str(out / "commits"), commit_every=5)
        elif spec == "ld_elastic_diloco":
            strategy = ElasticDiLoCo(dirpath=str(out / "commits"), commit_every=5, **diloco)
        else:
            strategy = DiLoCo(**diloco)
    devices = int(os.environ.get("WORLD_SIZE", "2")) if spec.startswith("ld_horovod") else 2
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1 if spec.startswith("ld_horovod") else devices,
        strategy=strategy,
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=[monitor, Losses()],
        deterministic=True,
    )
    trainer.fit(model)
    summary = monitor.summary()
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "losses": [repr(x) for x in losses],
        "weights_sha256": weights_sha256(model),
        "bytes": {k: v for k, v in summary.items() if "bytes" in k or k.endswith("calls")},
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, sort_keys=True))
    from lightning_dist import collectives

    collectives.shutdown()


def launch(name: str, tmp: Path) -> dict[str, Any]:
    launcher, spec = CONFIGS[name]
    out = tmp / name
    out.mkdir(parents=True)
    me = [sys.executable, os.path.abspath(__file__), "--child", spec, "--child-out", str(out)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *me[1:]]
    elif launcher == "mpirun":
        cmd = ["mpirun", "-np", "2", "--bind-to", "none", "--allow-run-as-root", "-x", "PYTHONPATH", *me]
    else:
        cmd = me
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"seconds": round(time.monotonic() - start, 1), "ranks": ranks}


def compare(now: dict[str, Any], before: dict[str, Any]) -> bool:
    same_all = True
    print(f"{'configuration':24} {'losses':8} {'weights':8} {'bytes':8}")
    for name in now:
        a, b = now[name], before.get(name)
        if b is None or "error" in a or "error" in b:
            print(f"{name:24} {'missing or failed':26}")
            same_all = False
            continue
        cells = []
        for key in ("losses", "weights_sha256", "bytes"):
            same = all(x[key] == y[key] for x, y in zip(a["ranks"], b["ranks"], strict=True))
            same_all &= same
            cells.append("same" if same else "DIFFERS")
        print(f"{name:24} {cells[0]:8} {cells[1]:8} {cells[2]:8}")
    return same_all


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write every configuration's record here (JSON)")
    parser.add_argument("--compare", help="a JSON written by an earlier run: exit 1 on any difference")
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        child(a.child, Path(a.child_out))
        return 0
    names = a.only.split(",") if a.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--only: unknown {unknown}; accepted: {', '.join(CONFIGS)}")
    tmp = Path(tempfile.mkdtemp(prefix="pov-"))
    results: dict[str, Any] = {}
    try:
        for i, name in enumerate(names, 1):
            results[name] = launch(name, tmp)
            state = "failed" if "error" in results[name] else f"{results[name]['seconds']} s"
            print(f"[pov] {name}: {state} ({i}/{len(names)})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    if a.compare:
        return 0 if compare(results, json.loads(Path(a.compare).read_text())) else 1
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
