"""Low-communication training: bytes per step against validation loss, and step time on a slow link.

    sudo python benchmarks/bench_low_comm.py [--rate-mbit 100] [--rows ddp diloco32_int8 ...]

One epoch of the embedded workload on 2 processes, same samples (each rank reads its half of every
global batch) and the same AdamW settings for every row: ``DDP()``, ``DiLoCo(H)`` for H in
{8, 32, 128} with and without int8, ``Compressed("demo")`` (packed and unpacked; DeMo is a signum
update: plain SGD with the same lr, as in bench_compression.py) and ``Compressed("powersgd")``.
Each row runs across two emulated nodes (network namespaces joined by a veth link capped at
``--rate-mbit`` with ``tc tbf``; needs root), so the step times are those of a slow link; without root
the rows run on this host and the step-time column says so. A single process on this host, same
per-rank batch, gives the step-time reference.

Per row: bytes one rank sent per optimizer step (every collective of the training steps, from the
collectives counters, so the 4-byte ``train_loss`` sync is in), its ratio to ``DDP()``, the final
validation loss and its ratio to ``DDP()``'s, and the mean and median step time and the mean's ratio
to the single process's. Writes ``low_comm.md`` and ``low_comm.png`` (bytes against loss) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

RESULTS = Path(__file__).resolve().parent / "results"

ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (strategy kind, options)
    "ddp": ("ddp", {}),
    "diloco8": ("diloco", {"inner_steps": 8}),
    "diloco32": ("diloco", {"inner_steps": 32}),
    "diloco128": ("diloco", {"inner_steps": 128}),
    "diloco8_int8": ("diloco", {"inner_steps": 8, "compression": "int8"}),
    "diloco32_int8": ("diloco", {"inner_steps": 32, "compression": "int8"}),
    "diloco128_int8": ("diloco", {"inner_steps": 128, "compression": "int8"}),
    "diloco32_int8_paper": (
        "diloco",
        {"inner_steps": 32, "compression": "int8", "outer_lr": 0.7, "outer_momentum": 0.9},
    ),
    "demo": ("demo", {}),
    "demo_top3": ("demo", {"topk": 3}),
    "powersgd": ("powersgd", {"rank": 4, "warmup": 0}),  # compressed from step 0, as measured
}
LABELS = {
    "ddp": "DDP() (reference)",
    "diloco8": "DiLoCo(H=8)",
    "diloco32": "DiLoCo(H=32)",
    "diloco128": "DiLoCo(H=128)",
    "diloco8_int8": "DiLoCo(H=8, int8)",
    "diloco32_int8": "DiLoCo(H=32, int8)",
    "diloco128_int8": "DiLoCo(H=128, int8)",
    "diloco32_int8_paper": "DiLoCo(H=32, int8, outer_lr=0.7, momentum=0.9)",
    "demo": "Compressed('demo') (64/4, packed)",
    "demo_top3": "Compressed('demo', topk=3) (packed)",
    "powersgd": "Compressed('powersgd', rank=4)",
}
DILOCO_OUTER: dict[str, Any] = {"outer_lr": 1.0, "outer_momentum": 0.5}
"""Outer-optimizer options of the DiLoCo rows that set none themselves (``--diloco-options``). On this
workload (2 ranks, 488 steps, H=32, int8) a sweep gave val loss 2.069 at (1.0, 0.5), 2.090 at (0.7, 0.5),
2.103 at (1.0, 0.0), 2.131 at DiLoCo's published (0.7, 0.9), 2.217 at (1.0, 0.9); DDP() 1.977."""
WARMUP = 5
"""Steps left out of the step-time figures (first-step set-up, DDP's bucket rebuild)."""


# ---------------------------------------------------------------------------------------------- worker
def _strategy(kind: str, options: dict[str, Any]) -> Any:
    from lightning_dist import DDP, Compressed, DiLoCo

    if kind == "ddp":
        return DDP()
    if kind == "diloco":
        return DiLoCo(**{**DILOCO_OUTER, **options})
    return Compressed(kind, log_stats=False, **options)


def worker(a: argparse.Namespace) -> None:
    """Fit one row for one epoch (or ``--max-steps``); rank 0 writes its figures to ``--out``."""
    import lightning as L
    import torch
    from meters import PlainSgdOption, StepMeter  # benchmarks/ is on sys.path when a benchmark runs

    from lightning_dist import collectives
    from lightning_dist.workload import WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    DILOCO_OUTER.clear()
    DILOCO_OUTER.update(json.loads(a.diloco_options))
    kind, options = ROWS[a.worker] if a.worker != "single" else ("single", {})
    torch.set_num_threads(1)
    L.seed_everything(1234, verbose=False)
    config = WorkloadConfig(
        seed=1234, optimizer="sgd" if kind == "demo" else "adamw", **json.loads(a.workload)
    )
    model = PlainSgdOption(kind == "demo", config=config)  # DeMo: signum update, plain SGD
    meter = StepMeter()
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1 if kind == "single" or a.num_nodes > 1 else 2,
        num_nodes=a.num_nodes,
        strategy="auto" if kind == "single" else _strategy(kind, options),
        max_epochs=1,
        max_steps=a.max_steps,
        limit_val_batches=1.0,
        num_sanity_val_steps=0,
        callbacks=[meter],
        deterministic=True,
    )
    trainer.fit(model)
    metrics = trainer.validate(model, verbose=False)[0]
    if trainer.global_rank == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {
            "row": a.worker,
            "steps": len(meter.step_seconds),
            "bytes_per_step": sum(meter.step_bytes) / max(1, len(meter.step_bytes)),
            "val_loss": float(metrics["val_loss"]),
            "step_seconds": meter.step_seconds[WARMUP:],
            "params": params,
            "world_size": trainer.world_size,
        }
        Path(a.out).write_text(json.dumps(result))
    collectives.shutdown()  # no process group left to interpreter finalisation (it can abort the exit)


# ------------------------------------------------------------------------------------------ controller
def _worker_argv(row: str, out: Path, a: argparse.Namespace, num_nodes: int, max_steps: int) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        row,
        "--out",
        str(out),
        "--num-nodes",
        str(num_nodes),
        "--max-steps",
        str(max_steps),
        "--workload",
        a.workload,
        "--diloco-options",
        a.diloco_options,
    ]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    # OMP_NUM_THREADS=1: Lightning otherwise gives a rank alone on its node (devices=1) every core
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def _run_on_host(argv: list[str], timeout: float) -> None:
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def run_row(row: str, a: argparse.Namespace, tmp: Path, cluster: Any, max_steps: int) -> dict[str, Any]:
    """One row's 2-process fit, across the emulated nodes when ``cluster`` is up, else on this host."""
    out = tmp / f"{row}.json"
    if cluster is None:
        _run_on_host(_worker_argv(row, out, a, 1, max_steps), a.timeout)
    else:
        results = cluster.run_each(_worker_argv(row, out, a, 2, max_steps), timeout=a.timeout, env=_env())
        for i, r in enumerate(results):
            if r.returncode != 0:
                raise RuntimeError(f"row {row}, node {i} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(out.read_text())


def table(results: dict[str, dict[str, Any]], single: dict[str, Any], where: str) -> list[str]:
    """The markdown table: one line per row, ratios against ``DDP()`` and the single process."""
    ref = results["ddp"]
    single_mean = statistics.fmean(single["step_seconds"])
    lines = [
        f"| row | bytes/step | vs DDP | val loss | vs DDP | mean step ({where}) | median step | mean vs 1 process |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, r in results.items():
        mean, median = statistics.fmean(r["step_seconds"]), statistics.median(r["step_seconds"])
        lines.append(
            f"| {LABELS[row]} | {r['bytes_per_step']:,.0f} | 1/{ref['bytes_per_step'] / max(r['bytes_per_step'], 1e-9):.1f}"
            f" | {r['val_loss']:.4f} | {r['val_loss'] / ref['val_loss']:.3f} | {mean * 1e3:.1f} ms"
            f" | {median * 1e3:.1f} ms | {mean / single_mean:.2f}x |"
        )
    lines.append(
        f"| one process (step-time reference) | 0 | - | {single['val_loss']:.4f} | - | {single_mean * 1e3:.1f} ms"
        f" | {statistics.median(single['step_seconds']) * 1e3:.1f} ms | 1.00x |"
    )
    return lines


def plot(results: dict[str, dict[str, Any]], path: Path, machine: str = "") -> None:
    """Bytes per step (log) against final validation loss: one numbered point per row, the labels in
    a legend beside the axes (so none overlap); ``machine`` goes in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for n, (row, r) in enumerate(results.items(), 1):
        label = LABELS.get(row, row)
        marker = (
            "*"
            if row == "ddp"
            else "s"
            if "int8" in row
            else "^"
            if "demo" in label or "powersgd" in row
            else "o"
        )
        ax.scatter(r["bytes_per_step"], r["val_loss"], s=90 if marker == "*" else 40, marker=marker,
                   color=f"C{(n - 1) % 10}", label=f"{n}  {label}", zorder=3)  # fmt: skip
        ax.annotate(str(n), (r["bytes_per_step"], r["val_loss"]), fontsize=8, xytext=(5, 4),
                    textcoords="offset points")  # fmt: skip
    ref = results["ddp"]["val_loss"]
    ax.axhline(ref * 1.05, color="grey", linestyle="--", linewidth=0.8, label="DDP loss + 5%")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per optimizer step per rank (log)")
    ax.set_ylabel("validation loss after one epoch")
    title = "Low-communication training: bytes vs loss (2 ranks, embedded workload)"
    ax.set_title(f"{title}\n{machine}" if machine else title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(results_dir: Path) -> None:
    """Redraw ``low_comm.png`` from the table in ``low_comm.md`` (no run)."""
    lines = (results_dir / "low_comm.md").read_text().splitlines()
    by_label = {label: row for row, label in LABELS.items()}
    results: dict[str, dict[str, Any]] = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        label = cells[0]
        if label in by_label and len(cells) > 3:
            results[by_label[label]] = {"bytes_per_step": float(cells[1].replace(",", "")),
                                        "val_loss": float(cells[3])}  # fmt: skip
    from machine_info import plot_caption

    plot(results, results_dir / "low_comm.png", plot_caption(lines[0]))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows to run (ddp always)"
    )
    p.add_argument("--rate-mbit", type=float, default=100.0, help="link cap between the 2 nodes")
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
    p.add_argument("--workload", default="{}", help="JSON overrides for WorkloadConfig")
    p.add_argument(
        "--diloco-options",
        default=json.dumps(DILOCO_OUTER),
        help="JSON outer options of the DiLoCo rows that set none (default: %(default)s)",
    )
    p.add_argument("--no-cluster", action="store_true", help="run every row on this host (no link cap)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per row")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for low_comm.md and low_comm.png")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--num-nodes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--replot", action="store_true", help="only redraw low_comm.png from --out's low_comm.md")
    a = p.parse_args(argv)
    if a.replot:
        replot(a.out)
        print(f"wrote {a.out / 'low_comm.png'}")
        return 0
    if a.worker:
        worker(a)
        return 0
    from machine_info import machine  # benchmarks/ is on sys.path when a benchmark runs

    from lightning_dist.cluster import netns

    rows = ["ddp"] + [r for r in a.rows if r != "ddp"]
    reason = "--no-cluster" if a.no_cluster else netns.unavailable_reason()
    where = f"2 nodes, {a.rate_mbit:g} Mbit/s" if reason is None else "this host, no cap"
    if reason is not None:
        print(f"bench_low_comm: no emulated cluster ({reason}); every row runs on this host", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ld_low_comm_") as tmp_dir:
        tmp = Path(tmp_dir)
        cluster = None if reason is not None else netns.EmulatedCluster(2, rate_mbit=a.rate_mbit).up()
        try:
            for i, row in enumerate(rows, 1):
                t0 = time.monotonic()
                print(f"[{i}/{len(rows)}] {LABELS[row]} ...", end=" ", flush=True)
                results[row] = r = run_row(row, a, tmp, cluster, a.max_steps)
                print(
                    f"{r['steps']} steps, {r['bytes_per_step']:,.0f} B/step, val loss {r['val_loss']:.4f}, "
                    f"mean step {statistics.fmean(r['step_seconds']) * 1e3:.1f} ms ({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
        finally:
            if cluster is not None:
                cluster.down()
        print(f"[single] one process on this host, {results['ddp']['steps']} steps ...", end=" ", flush=True)
        out = tmp / "single.json"
        _run_on_host(_worker_argv("single", out, a, 1, results["ddp"]["steps"]), a.timeout)
        single = json.loads(out.read_text())
        print(f"mean step {statistics.fmean(single['step_seconds']) * 1e3:.1f} ms", flush=True)
    ddp = results["ddp"]
    header = [
        f"machine: {machine()}",
        f"command: python benchmarks/bench_low_comm.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip(),
        f"workload: {ddp['params']:,} parameters, {ddp['steps']} optimizer steps (one epoch) on 2 processes x 1 thread, "
        f"Gloo, AdamW (DeMo: SGD, same lr); DiLoCo outer options unless the row names them: {a.diloco_options}",
        "",
    ]
    lines = header + table(results, single, where)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "low_comm.md").write_text("\n".join(lines) + "\n")
    from machine_info import plot_caption

    plot(results, a.out / "low_comm.png", plot_caption(machine(), time.strftime("%Y-%m-%d")))
    print("\n" + "\n".join(lines))
    print(f"\nwrote {a.out / 'low_comm.md'} and {a.out / 'low_comm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
