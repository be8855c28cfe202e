"""Every compressor on the embedded workload, 2 CPU processes over Gloo, against uncompressed DDP.

    python benchmarks/bench_compression.py [--steps 120] [--rounds 2] [--workload '{"d_model": 128}']

One 2-process job (Lightning's popen launcher re-runs this file per rank) fits the workload once per
row per round, rows in a rotated order each round so a shared machine's noise spreads over all.
Printed per row: gradient bytes one rank sends per optimizer step (from the collectives counters,
between ``on_before_backward`` and ``on_after_backward``), their ratio against a ring all-reduce of
the fp32 gradients, the final validation loss, the median step time (after warm-up, pooled over
rounds) and its ratio against ``DDP()`` (uncompressed, same transport). torch's own fp16 and
PowerSGD comm hooks run as references through torch.distributed directly, so their bytes are not
counted. Optimizer: AdamW (the workload's) for every row but DeMo, which is plain SGD with the same
lr (DeMo keeps the momentum and returns a sign update).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Any

import lightning as L
import torch
from meters import GradBytes, PlainSgdOption, StepMeter  # benchmarks/ is on sys.path when a benchmark runs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from typing_extensions import override

from lightning_dist import DDP, Compressed
from lightning_dist.compression import reference_bytes
from lightning_dist.workload import WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("DDP() (reference)", "ddp", {}),
    ("Compressed none", "none", {}),
    ("Compressed fp16", "fp16", {}),
    ("Compressed bf16", "bf16", {}),
    ("Compressed int8", "int8", {}),
    ("Compressed powersgd rank 4", "powersgd", {"rank": 4, "warmup": 0}),  # compressed from step 0
    ("Compressed topk 1%", "topk", {"ratio": 0.01}),
    ("Compressed sign", "sign", {}),
    ("Compressed demo (SGD)", "demo", {}),
    ("torch fp16_compress_hook", "torch_fp16", {}),
    ("torch powerSGD_hook rank 4, one bucket", "torch_powersgd", {}),
]


class TorchHookDDP(DDP):
    """``DDP()`` with one of torch's built-in comm hooks (they call torch.distributed themselves)."""

    def __init__(self, which: str) -> None:
        self.which = which
        # torch's PowerSGD hook fails on Gloo with more than one bucket (seen with torch 2.13): one bucket
        super().__init__(bucket_cap_mb=1000 if which == "torch_powersgd" else None)

    @override
    def _make_hook_state(self) -> Any:
        if self.which == "torch_powersgd":
            return powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
            )
        return None

    @override
    def _comm_hook(self) -> Any:
        return (
            powerSGD_hook.powerSGD_hook
            if self.which == "torch_powersgd"
            else default_hooks.fp16_compress_hook
        )


def make_strategy(kind: str, options: dict[str, Any]) -> Any:
    if kind == "ddp":
        return DDP()
    if kind.startswith("torch_"):
        return TorchHookDDP(kind)
    return Compressed(kind, log_stats=False, **options)


def fit(kind: str, options: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(1234, verbose=False)
    workload = json.loads(a.workload)
    model = PlainSgdOption(kind == "demo", config=WorkloadConfig(seed=1234, **workload))
    steps, grads = StepMeter(), GradBytes()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=make_strategy(kind, options),
        max_steps=a.steps,
        limit_val_batches=a.val_batches,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        callbacks=[steps, grads],
        deterministic=True,
    )
    trainer.fit(model)
    val_loss = float(trainer.validate(model, verbose=False)[0]["val_loss"])
    shapes = [p.shape for p in model.parameters()]
    return {
        "rank": trainer.global_rank,
        "val_loss": val_loss,
        "step_seconds": steps.step_seconds[a.warmup :],
        "grad_bytes": statistics.median(grads.grad_bytes[a.warmup :]),
        "reference_bytes": reference_bytes(shapes, trainer.world_size),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--workload", default="{}", help="JSON overrides for WorkloadConfig")
    p.add_argument("--only", default="", help="comma-separated row kinds (default: all)")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    rows = [r for r in ROWS if not a.only or r[1] in a.only.split(",") or r[1] == "ddp"]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in rows}
    for i in range(a.rounds):
        shift = i % len(rows)
        for label, kind, options in rows[shift:] + rows[:shift]:
            results[label].append(fit(kind, options, a))
    if results[rows[0][0]][0]["rank"] != 0:
        return
    ref = statistics.median(t for r in results[rows[0][0]] for t in r["step_seconds"])
    first = results[rows[0][0]][0]
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, torch {torch.__version__}, 2 processes x 1 thread, Gloo"
    )
    print(f"command: python benchmarks/bench_compression.py {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"workload: {first['params']:,} parameters, {a.steps} steps, {a.rounds} round(s); fp32 ring all-reduce "
        f"of the gradients = {first['reference_bytes']:,} bytes per rank per step"
    )
    print()
    print("| row | grad bytes/step | vs fp32 ring | final val loss | median step | vs DDP() |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, kind, _ in rows:
        rs = results[label]
        step = statistics.median(t for r in rs for t in r["step_seconds"])
        loss = statistics.median(r["val_loss"] for r in rs)
        counted = not kind.startswith("torch_")
        nbytes = f"{int(rs[0]['grad_bytes']):,}" if counted else "not counted"
        ratio = f"{rs[0]['grad_bytes'] / rs[0]['reference_bytes']:.4f}" if counted else "-"
        print(f"| {label} | {nbytes} | {ratio} | {loss:.4f} | {step * 1e3:.1f} ms | {step / ref:.2f}x |")


if __name__ == "__main__":
    main()
