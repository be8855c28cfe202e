#!/usr/bin/env python
"""Proof of value for refactors: every strategy's numbers, bitwise, before and after a change.

Trains the embedded workload (``WorkloadConfig.tiny``) for a few steps with every strategy class and
its presets on 2 CPU processes and records, per process, every step's loss (exact float), a SHA-256
of the final weights (gathered where sharded), and the CommMonitor byte counters. Run it on the
commit before a refactor and on the commit after; with ``--compare`` it prints one row per
configuration and exits 1 when anything differs.

    python scripts/proof-of-value.py --out /tmp/pov-before.json            # on the old commit
    python scripts/proof-of-value.py --out /tmp/pov-after.json --compare /tmp/pov-before.json

Launchers: Lightning's (DDP with start_method "popen" and "fork", Compressed, DiLoCo, Sharded,
ShardedDiLoCo), torchrun (Elastic, ElasticDiLoCo), mpirun (Horovod, HorovodAdasum), horovodrun's
elastic engine on one host of 2 slots (HorovodElastic, fault-free), and the pack's FaultTolerant
launcher (a Lighthouse that forms a quorum only of both groups, 2 replica groups of one process
each, fault-free, no restarts). Every configuration is bitwise reproducible run to run on this
machine, on a loaded machine too; a FaultTolerant run would not be if a group could
train a step alone, which ``--min-replicas 2`` rules out. Commits go to each configuration's folder:
a run never resumes another's. ``bytes`` are CommMonitor's medians per step (DiLoCo's syncs every 4
steps give 0); FaultTolerant's loss is Lightning's micro-batch loss, scaled by 1/micro-batches of the
step (2). DDP with start_method "spawn" is not here: spawn pickles the Trainer and this file's callback
is a local class.

``--only NAME[,NAME]`` runs some configurations. A row's child process runs this file with
``--child`` (its launcher starts it once per process). The script imports only public names, so it
runs on trees before and after the strategies' modules moved.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

STEPS = 12
SEED = 7
PROCESSES = 2

# name -> (launcher, strategy spec for the child: a registered name, or a key of built_strategies)
CONFIGS: dict[str, tuple[str, str]] = {
    "lightning_ddp": ("lightning", "ddp"),
    "ld_ddp": ("lightning", "ld_ddp"),
    "ld_ddp_adasum": ("lightning", "ld_ddp_adasum"),
    "ld_ddp_fork": ("lightning", "ld_ddp_fork"),
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
    "ld_horovod_sum": ("mpirun", "ld_horovod_sum"),
    "ld_horovod_elastic": ("horovodrun", "horovod_elastic"),
    "ld_sharded": ("lightning", "ld_sharded"),
    "ld_sharded_int8": ("lightning", "ld_sharded_int8"),
    "sharded_hybrid_int8": ("lightning", "sharded_hybrid_int8"),
    "ld_sharded_diloco": ("lightning", "sharded_diloco"),
    "ld_sharded_diloco_int8": ("lightning", "sharded_diloco_int8"),
    "ld_fault_tolerant": ("torchft", "ld_fault_tolerant"),
    "ld_fault_tolerant_int8": ("torchft", "ld_fault_tolerant_int8"),
    "ld_fault_tolerant_diloco": ("torchft", "fault_tolerant_diloco"),
}
CONFIGS_BY_SPEC = {spec: launcher for launcher, spec in CONFIGS.values()}


def built_strategies(out: Path) -> dict[str, Callable[[], Any]]:
    """The specs that are strategy objects (DiLoCo syncs every 4 steps, so 3 times in the run); every
    commit goes to the configuration's own folder (a commit left by another run would be resumed)."""
    import lightning_dist as ld

    commits = str(out / "commits")
    return {
        "ld_diloco": lambda: ld.DiLoCo(inner_steps=4, compression=None),
        "ld_diloco_int8": lambda: ld.DiLoCo(inner_steps=4, compression="int8"),
        "ld_elastic": lambda: ld.Elastic(dirpath=commits, commit_every=5),
        "ld_elastic_diloco": lambda: ld.ElasticDiLoCo(dirpath=commits, commit_every=5, inner_steps=4),
        "horovod_elastic": lambda: ld.HorovodElastic(commit_every=1, dirpath=commits),
        "sharded_hybrid_int8": lambda: ld.Sharded(replicas=2, replica_sync="int8"),
        "sharded_diloco": lambda: ld.ShardedDiLoCo(inner_steps=4),
        "sharded_diloco_int8": lambda: ld.ShardedDiLoCo(inner_steps=4, compression="int8"),
        "ld_fault_tolerant": lambda: ld.FaultTolerant(dirpath=commits),
        "ld_fault_tolerant_int8": lambda: ld.FaultTolerant(compressor="int8", dirpath=commits),
        "fault_tolerant_diloco": lambda: ld.FaultTolerantDiLoCo(inner_steps=4, dirpath=commits),
    }


def weights_sha256(module: Any) -> str:
    """SHA-256 over every state-dict tensor's name, dtype, shape and bytes, in key order (a sharded
    tensor gathered first: a collective, every process calls it)."""
    import torch
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        t = full.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def process_index(trainer: Any) -> int:
    """This process's place in the job: its rank, after the processes of the replica groups before
    its own (FaultTolerant: each group's Trainer counts its ranks from 0)."""
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    return group * trainer.world_size + trainer.global_rank


def fit(spec: str, out: Path, callbacks: list[Any]) -> None:
    """Build the model, the strategy and the Trainer for ``spec``, and fit."""
    import lightning as L

    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    L.seed_everything(SEED, workers=True, verbose=False)
    model = TinyCausalLM(WorkloadConfig.tiny(seed=SEED))
    launcher = CONFIGS_BY_SPEC[spec]
    one_per_process = launcher in ("mpirun", "horovodrun", "torchft")

    def make_trainer() -> Any:
        build = built_strategies(out).get(spec)
        return quiet_trainer(
            accelerator="cpu",
            devices=1 if one_per_process else PROCESSES,
            strategy=build() if build else spec,
            max_steps=STEPS,
            limit_val_batches=0,
            callbacks=callbacks,
            deterministic=True,
        )

    if launcher == "horovodrun":
        from lightning_dist.launch.horovod_elastic import fit_horovod_elastic

        fit_horovod_elastic(make_trainer, model)
    else:
        make_trainer().fit(model)


def recorder(out: Path) -> Any:
    """A callback keeping each step's loss that writes this process's record at the end of training
    (in the process that trained: under the fork launcher, a worker) to ``out/rank<index>.json``."""
    import lightning as L

    from lightning_dist.callbacks import CommMonitor

    class Record(L.Callback):
        def __init__(self) -> None:
            self.monitor = CommMonitor(log=False)
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            self.losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            summary = self.monitor.summary()
            record = {
                "rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "losses": [repr(x) for x in self.losses],
                "weights_sha256": weights_sha256(pl_module),
                "bytes": {k: v for k, v in summary.items() if "bytes" in k or k.endswith("calls")},
            }
            path = out / f"rank{process_index(trainer)}.json"
            path.write_text(json.dumps(record, sort_keys=True))

    return Record()


def child(spec: str, out: Path) -> None:
    """One process's training (the fork launcher's parent: its workers')."""
    import torch

    import lightning_dist  # noqa: F401  (registers the ld_ names)
    from lightning_dist import collectives

    torch.set_num_threads(1)
    record = recorder(out)
    fit(spec, out, [record.monitor, record])
    collectives.shutdown()


def command(launcher: str, me: list[str], out: Path) -> list[str]:
    """The command line that starts ``me`` (this file as a child) under ``launcher``."""
    n, module = str(PROCESSES), [sys.executable, "-m"]
    if launcher == "torchrun":
        return [*module, "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *me[1:]]
    if launcher == "mpirun":
        return ["mpirun", "-np", n, "--bind-to", "none", "--allow-run-as-root", "-x", "PYTHONPATH", *me]
    if launcher == "horovodrun":
        discover = out / "discover.sh"
        discover.write_text(f"#!/bin/sh\necho localhost:{n}\n")
        discover.chmod(0o755)
        elastic = ["--min-np", n, "--max-np", n, "--host-discovery-script", str(discover)]
        return ["horovodrun", "-np", n, *elastic, "--network-interface", "lo", *me]
    if launcher == "torchft":
        groups = ["--groups", n, "--min-replicas", n, "--max-restarts", "0", "--cold"]
        return [*module, "lightning_dist.launch.fault_tolerant", *groups, "--", *me[1:]]
    return me


def launch(name: str, tmp: Path) -> dict[str, Any]:
    """Run one configuration; its per-process records, or the end of its output on failure."""
    launcher, spec = CONFIGS[name]
    out = tmp / name
    out.mkdir(parents=True)
    me = [sys.executable, os.path.abspath(__file__), "--child", spec, "--child-out", str(out)]
    env = {**os.environ, "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    start = time.monotonic()
    proc = subprocess.run(command(launcher, me, out), capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    if any(len(r["losses"]) != STEPS for r in ranks):
        return {"error": f"trained {[len(r['losses']) for r in ranks]} steps; expected {STEPS}"}
    return {"seconds": round(time.monotonic() - start, 1), "ranks": ranks}


def compare(now: dict[str, Any], before: dict[str, Any]) -> bool:
    """Print one row per configuration of ``now``; whether all equal ``before``'s."""
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
    start = time.monotonic()
    try:
        for i, name in enumerate(names, 1):
            results[name] = launch(name, tmp)
            state = "failed" if "error" in results[name] else f"{results[name]['seconds']} s"
            print(f"[pov] {name}: {state} ({i}/{len(names)})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[pov] {len(names)} configurations in {time.monotonic() - start:.0f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    if a.compare:
        return 0 if compare(results, json.loads(Path(a.compare).read_text())) else 1
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
