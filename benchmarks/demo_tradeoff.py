"""DeMo's bytes/loss trade-off: one epoch of the embedded workload, 2 CPU processes over Gloo, per setting.

    python benchmarks/demo_tradeoff.py [--epochs 1] [--only 0,3,4] [--workload '{"train_bytes": 500000}']
    python benchmarks/demo_tradeoff.py --timing     # one process: compressor CPU time per step

One 2-process job (Lightning's popen launcher re-runs this file per rank) fits the workload once per
row. Printed per row: gradient bytes one rank sends per optimizer step (from the collectives
counters, between ``on_before_backward`` and ``on_after_backward``; checked against the
compressor's ``wire_bytes``), how many times fewer than a ring all-reduce of the fp32 gradients, the
final validation loss (the whole validation split) and its ratio to ``DDP()``'s. ``DDP()`` trains
with the workload's AdamW; DeMo rows with plain SGD at the same lr (DeMo keeps the momentum and
returns a sign update, so SGD's step is lr * sign).

``--timing`` measures, in one process with one thread, the DeMo compressor's CPU time per step for
one rank of 2 (send side: momentum, DCT, top-k, packing; receive side: unpacking, scatter, inverse
DCT, sign) on the gradients of the 4.2M-parameter MLP (4 x Linear(1024, 1024) + ReLU and a head),
next to that MLP's forward + backward + AdamW step at batch 32; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch
from meters import GradBytes, PlainSgdOption  # benchmarks/ is on sys.path when a benchmark runs
from torch import nn

from lightning_dist import DDP, Compressed
from lightning_dist.compression import make_compressor, reference_bytes
from lightning_dist.workload import WorkloadConfig
from lightning_dist.workload.trainer import quiet_trainer

ROWS: list[tuple[str, dict[str, Any]]] = [
    ("DDP() (reference, AdamW)", {}),
    ("demo 64/4 fp32 values + uint8 indices (the old layout)", {"values": "fp32", "indices": "bytes"}),
    ("demo 64/4 sign + 6-bit indices", {"values": "sign", "indices": "bits"}),
    ("demo 64/4 sign + subset code (default)", {}),
    ("demo 64/4 sign (scale per chunk) + subset code", {"scale_group": 1}),
    ("demo 64/3 sign + subset code", {"topk": 3}),
    ("demo 128/4 sign + subset code", {"chunk_size": 128}),
    ("demo 64/2 sign + subset code", {"topk": 2}),
]


def fit(index: int, a: argparse.Namespace) -> dict[str, Any]:
    label, options = ROWS[index]
    L.seed_everything(1234, verbose=False)
    model = PlainSgdOption(index > 0, config=WorkloadConfig(seed=1234, **json.loads(a.workload)))
    meter = GradBytes()
    strategy = DDP() if index == 0 else Compressed("demo", log_stats=False, **options)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=a.epochs,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        callbacks=[meter],
        deterministic=True,
    )
    start = time.perf_counter()
    trainer.fit(model)
    seconds = time.perf_counter() - start
    val_loss = float(trainer.validate(model, verbose=False)[0]["val_loss"])
    shapes = [tuple(p.shape) for p in model.parameters()]
    steady = meter.grad_bytes[1:]  # step 0 runs before DDP rebuilds its buckets
    expected = None
    if index:  # the wire model, bucket by bucket as DDP laid them out
        compressor = make_compressor("demo", **options)
        layout = trainer.strategy.hook_state.layout  # type: ignore[attr-defined]
        expected = sum(compressor.wire_bytes([shapes[i] for i in b], 2) for b in layout.values())
    return {
        "label": label,
        "rank": trainer.global_rank,
        "val_loss": val_loss,
        "grad_bytes": statistics.median(steady),
        "bytes_constant": min(steady) == max(steady),
        "expected_bytes": expected,
        "reference_bytes": reference_bytes(shapes, trainer.world_size),
        "params": sum(p.numel() for p in model.parameters()),
        "steps": trainer.global_step,
        "seconds": seconds,
    }


def print_row(r: dict[str, Any], ref_loss: float) -> None:
    times = r["reference_bytes"] / r["grad_bytes"]
    check = "" if r["expected_bytes"] in (None, r["grad_bytes"]) else f" (model: {r['expected_bytes']:,})"
    print(
        f"| {r['label']} | {int(r['grad_bytes']):,}{check} | {times:.1f}x | {r['val_loss']:.4f} | "
        f"{r['val_loss'] / ref_loss:.3f} | {r['seconds']:.0f} s |",
        flush=True,
    )


def trade_off(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    rows = (
        [0] + [int(i) for i in a.only.split(",") if i and int(i) != 0] if a.only else list(range(len(ROWS)))
    )
    results = []
    for i in rows:
        results.append(fit(i, a))
        if results[-1]["rank"] == 0:
            print(f"# {json.dumps(results[-1])}", flush=True)
    if results[0]["rank"] != 0:
        return
    first = results[0]
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, torch {torch.__version__}, 2 processes x 1 thread, Gloo"
    )
    print(f"command: python benchmarks/demo_tradeoff.py {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"workload: {first['params']:,} parameters, {a.epochs} epoch(s) = {first['steps']} steps; fp32 ring "
        f"all-reduce of the gradients = {first['reference_bytes']:,} bytes per rank per step"
    )
    print()
    print("| setting | grad bytes/step | fewer than fp32 ring | final val loss | vs DDP() | fit time |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print_row(r, first["val_loss"])


def timing(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    mlp = nn.Sequential(*layers, nn.Linear(1024, 10))
    shapes = [tuple(p.shape) for p in mlp.parameters()]
    x, y = torch.randn(32, 1024), torch.randint(0, 10, (32,))
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    w = 2
    grads = [[torch.randn(s) for s in shapes] for _ in range(w)]
    rows = [(label, [make_compressor("demo", **options) for _ in range(w)]) for label, options in ROWS[1:]]
    step_s: list[float] = []
    send: dict[str, list[float]] = {label: [] for label, _ in rows}
    recv: dict[str, list[float]] = {label: [] for label, _ in rows}
    for _ in range(a.reps):  # interleaved, so a shared machine's noise falls on every row alike
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(mlp(x), y).backward()
        opt.step()
        step_s.append(time.perf_counter() - t)
        for label, comps in rows:
            t0 = time.perf_counter()
            exs = [
                c.exchange(0, g, world_size=w, rank=r)
                for r, (c, g) in enumerate(zip(comps, grads, strict=True))
            ]
            t1 = time.perf_counter()
            gathered = torch.stack([ex.round.payload for ex in exs])  # type: ignore[union-attr]
            t2 = time.perf_counter()
            exs[0].feed(gathered.clone())
            t3 = time.perf_counter()
            for ex in exs[1:]:
                ex.feed(gathered.clone())
            send[label].append((t1 - t0) / w)
            recv[label].append(t3 - t2)
    print(f"MLP {sum(p.numel() for p in mlp.parameters()):,} parameters, batch 32, 1 thread, {a.reps} reps")
    med, low = statistics.median(step_s[2:]), min(step_s)
    print(f"forward + backward + AdamW: median {med * 1e3:.1f} ms (min {low * 1e3:.1f})")
    for label, _ in rows:
        s, r = statistics.median(send[label][2:]), statistics.median(recv[label][2:])
        total = min(a + b for a, b in zip(send[label], recv[label], strict=True))
        print(
            f"{label}: send {s * 1e3:.1f} ms + receive {r * 1e3:.1f} ms = {(s + r) * 1e3:.1f} ms "
            f"per rank per step (min {total * 1e3:.1f})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--only", default="", help="comma-separated row numbers (0 = DDP, always run)")
    p.add_argument("--workload", default="{}", help="JSON overrides for WorkloadConfig")
    p.add_argument("--timing", action="store_true", help="compressor CPU time on the 4.2M MLP instead")
    p.add_argument("--reps", type=int, default=12)
    a = p.parse_args()
    timing(a) if a.timing else trade_off(a)


if __name__ == "__main__":
    main()
