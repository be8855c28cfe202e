"""The demo: train the embedded workload on 2 local processes with every strategy, print a table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DemoRun:
    """One row of the demo table: a label, a strategy spec, and an optional launcher prefix."""

    label: str
    strategy: str
    launcher: list[str] = field(default_factory=list)
    devices: int = 2
    """Trainer ``devices`` per launched process: 2 when Lightning starts the ranks, 1 under mpirun."""
    needs: Optional[str] = None
    """A module that must import for this row to run (else the row is skipped with a reason)."""


MPIRUN = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "-x", "OMP_NUM_THREADS"]


def demo_runs() -> list[DemoRun]:
    mpirun = MPIRUN[:1] + (["--allow-run-as-root"] if os.geteuid() == 0 else []) + MPIRUN[1:]
    return [
        DemoRun("Lightning DDPStrategy (reference)", "ddp"),
        DemoRun("DDP()", "ld_ddp"),
        DemoRun("DDP(reduce_op='adasum')", "ld_ddp_adasum"),
        DemoRun("Compressed('fp16')", "compressed_fp16"),
        DemoRun("Compressed('int8')", "compressed_int8"),
        DemoRun("Compressed('powersgd', rank=4)", "compressed_powersgd"),
        DemoRun("Compressed('topk', ratio=0.01)", "compressed_topk"),
        DemoRun("Horovod() (mpirun)", "horovod", mpirun, devices=1, needs="horovod.torch"),
        DemoRun("HorovodAdasum() (mpirun)", "horovod_adasum", mpirun, devices=1, needs="horovod.torch"),
    ]


def _available(run: DemoRun) -> Optional[str]:
    if run.needs is None:
        return None
    try:
        __import__(run.needs)
    except ImportError as exc:
        return f"skipped: {exc}"
    if run.launcher and shutil.which(run.launcher[0]) is None:
        return f"skipped: {run.launcher[0]} not on PATH"
    return None


def run_one(run: DemoRun, steps: int, workdir: str, extra: list[str]) -> dict:
    out = os.path.join(workdir, f"{abs(hash(run.label))}.json")
    cmd = [
        *run.launcher,
        sys.executable,
        "-m",
        "lightning_dist.workload.train",
        "--strategy",
        run.strategy,
        "--devices",
        str(run.devices),
        "--max-steps",
        str(steps),
        "--json-out",
        out,
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    with open(out) as fh:
        return json.load(fh)["result"]


def format_table(rows: list[tuple[str, dict]]) -> str:
    header = f"| {'strategy':<36} | {'median step':>11} | {'bytes sent/step':>15} | {'final val loss':>14} |"
    lines = [header, "|" + "-" * 38 + "|" + "-" * 13 + "|" + "-" * 17 + "|" + "-" * 16 + "|"]
    for label, r in rows:
        if "error" in r or "skipped" in r:
            note = r.get("skipped") or "failed (see above)"
            lines.append(f"| {label:<36} | {note:>49} |")
            continue
        sent = "not counted" if r.get("strategy") == "ddp" else f"{int(r['bytes_sent_per_step']):,}"
        lines.append(
            f"| {label:<36} | {r['median_step_s'] * 1000:>8.1f} ms | {sent:>15} | "
            f"{r['final_val_loss']:>14.4f} |"
        )
    return "\n".join(lines)


def main(steps: int = 100, extra: Optional[list[str]] = None) -> int:
    extra = extra or []
    rows: list[tuple[str, dict]] = []
    failed = False
    with tempfile.TemporaryDirectory() as workdir:
        for run in demo_runs():
            reason = _available(run)
            if reason:
                print(f"[demo] {run.label}: {reason}", flush=True)
                rows.append((run.label, {"skipped": reason}))
                continue
            print(f"[demo] {run.label}: training {steps} steps on 2 processes ...", flush=True)
            result = run_one(run, steps, workdir, extra)
            if "error" in result:
                failed = True
                print(f"[demo] {run.label} FAILED\n{result['error']}", flush=True)
            rows.append((run.label, result))
    print()
    print(f"Embedded workload (stdlib byte LM), {steps} optimizer steps, 2 CPU processes, Gloo:")
    print(format_table(rows))
    print(
        "bytes sent/step: per rank, from lightning_dist.collectives counters (wire model: ring all-reduce);"
    )
    print(
        "Lightning's own DDPStrategy does not go through them. Step times are medians after 3 warm-up steps."
    )
    return 1 if failed else 0
