"""The demo: train the embedded workload on 2 local processes with every strategy, print a table.

The rows of one launcher (Lightning's, mpirun's) train one after another in one launch, so the
processes' start-up and imports are paid once (``run_rows``); each row seeds itself and its strategy
counts its own bytes, as in a launch of its own.

As root (with iproute2) it adds a column: each strategy's median step time across 2 emulated nodes
(``lightning_dist.cluster.netns.EmulatedCluster``: network namespaces joined by a veth pair capped
with tc tbf, 100 Mbit/s by default), one process per node, Horovod rows by mpirun across the nodes.
Elsewhere it prints one line saying why that column is skipped."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional


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
        DemoRun("Compressed('fp16')", "ld_compressed_fp16"),
        DemoRun("Compressed('int8')", "ld_compressed_int8"),
        DemoRun("Compressed('powersgd', rank=4)", "ld_compressed_powersgd"),
        DemoRun("Compressed('topk', ratio=0.01)", "ld_compressed_topk"),
        DemoRun("Horovod() (mpirun)", "ld_horovod", mpirun, devices=1, needs="horovod.torch"),
        DemoRun("HorovodAdasum() (mpirun)", "ld_horovod_adasum", mpirun, devices=1, needs="horovod.torch"),
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


def _train_argv(run: DemoRun, steps: int, out: str, extra: list[str], num_nodes: int = 1) -> list[str]:
    """The training command of one rank (without launcher)."""
    return [
        sys.executable,
        "-m",
        "lightning_dist.workload.train",
        "--strategy",
        run.strategy,
        "--devices",
        str(1 if num_nodes > 1 else run.devices),
        "--num-nodes",
        str(num_nodes),
        "--max-steps",
        str(steps),
        "--json-out",
        out,
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _read_result(out: str, returncode: int, tail: str) -> dict:
    if returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {returncode}: {tail[-2000:]}"}
    with open(out) as fh:
        return json.load(fh)["result"]


def _out(workdir: str, run: DemoRun) -> str:
    return os.path.join(workdir, f"{abs(hash(run.label))}.json")


def run_one(run: DemoRun, steps: int, workdir: str, extra: list[str]) -> dict:
    """``run`` in a launch of its own: its summary, or ``{"error": ...}``."""
    out = _out(workdir, run)
    cmd = [*run.launcher, *_train_argv(run, steps, out, extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    return _read_result(out, proc.returncode, proc.stderr or proc.stdout)


ROW_DONE = "[demo-row-done]"
"""What a launch of several rows prints (rank 0) after each row it trained."""


def run_rows(
    runs: list[DemoRun], steps: int, workdir: str, extra: list[str], done: Callable[[DemoRun, dict], None]
) -> None:
    """``runs`` (one launcher) one after another in one launch (``python -m
    lightning_dist.workload.demo ROWS``): the processes' start-up, imports and process group are paid
    once, not once a row. ``done(run, result)`` as each row ends (its summary, or ``{"error": ...}``);
    after a failed row the rows left start in a fresh launch."""
    todo = list(runs)
    while todo:
        outs = [_out(workdir, run) for run in todo]
        rows = [_train_argv(run, steps, out, extra)[3:] for run, out in zip(todo, outs)]
        cmd = [*todo[0].launcher, sys.executable, "-m", "lightning_dist.workload.demo", json.dumps(rows)]
        tail: collections.deque[str] = collections.deque(maxlen=200)
        finished = 0
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(ROW_DONE) and finished < len(todo):
                    done(todo[finished], _read_result(outs[finished], 0, ""))
                    finished += 1
                else:
                    tail.append(line)
        if finished < len(todo):  # this row failed, or the launch before it started
            done(todo[finished], {"error": f"exit {proc.returncode}: {''.join(tail)[-2000:]}"})
            finished += 1
        todo = todo[finished:]


def train_rows(rows: list[list[str]]) -> None:
    """One launch of ``run_rows``: each row's training (``lightning_dist.workload.train``'s
    arguments) in this process, one after another; rank 0 writes each row's summary to its
    ``--json-out`` and prints ``ROW_DONE``."""
    from lightning_dist import collectives
    from lightning_dist.workload.train import parse_args, train

    for argv in rows:
        run, json_out = parse_args(argv)
        result = train(run)
        if result["rank"] == 0:
            assert json_out is not None, "run_rows gives every row --json-out"
            with open(json_out, "w") as fh:
                json.dump({"run": asdict(run), "result": result}, fh)
            print(ROW_DONE, flush=True)
    collectives.shutdown()


def run_on_cluster(
    cluster: Any, run: DemoRun, steps: int, workdir: str, extra: list[str], timeout: float = 300
) -> dict:
    """``run`` across the 2 nodes of ``cluster`` (an up ``EmulatedCluster``): one process per node,
    or mpirun across the nodes when the row has a launcher (Horovod)."""
    out = os.path.join(workdir, f"{abs(hash(run.label))}-nodes.json")
    if os.path.exists(out):
        os.remove(out)
    if run.launcher:
        argv = _train_argv(run, steps, out, extra)
        mpirun = ["mpirun", "-np", "2", *cluster.mpirun_args(), "-x", "OMP_NUM_THREADS", *argv]
        proc = cluster.popen(0, mpirun, _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # mpirun and its local ranks (own session)
            return {"error": f"killed after {timeout}s"}
        return _read_result(out, proc.returncode, text)
    try:
        results = cluster.run_each(_train_argv(run, steps, out, extra, num_nodes=2), timeout, env=_env())
    except TimeoutError as err:
        return {"error": str(err)[-2000:]}
    code = max(abs(r.returncode) for r in results)
    return _read_result(out, code, "\n".join(r.stderr for r in results))


class Progress:
    """One line per finished row: its elapsed time and, from the rows so far, the time left."""

    def __init__(self, total: int, what: str = "") -> None:
        self.total, self.what, self.done, self.spent = total, what, 0, 0.0
        self._start = time.monotonic()

    def start(self) -> None:
        self._start = time.monotonic()

    def finish(self, label: str, status: str = "done") -> str:
        elapsed = time.monotonic() - self._start
        self.done += 1
        self.spent += elapsed
        left = self.total - self.done
        eta = f"about {_duration(self.spent / self.done * left)} left" if left else "all done"
        line = f"[demo] {label}{self.what}: {status} in {elapsed:.1f} s ({self.done}/{self.total}; {eta})"
        print(line, flush=True)
        return line


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def capped_column(
    rows: list[tuple[str, dict]], steps: int, workdir: str, extra: list[str], cap_mbit: float
) -> Optional[dict[str, dict]]:
    """Each row's result across 2 emulated nodes at ``cap_mbit``; None (with one line printed saying
    why) where no cluster can be built here."""
    from lightning_dist.cluster import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"[demo] capped-link column skipped: {reason}", flush=True)
        return None
    by_label = {run.label: run for run in demo_runs()}
    column: dict[str, dict] = {}
    todo = [label for label, local in rows if "error" not in local and "skipped" not in local]
    progress = Progress(len(todo), f" at {cap_mbit:g} Mbit/s")
    with netns.EmulatedCluster(2, rate_mbit=cap_mbit) as cluster:
        for i, (label, _) in enumerate(rows):
            cluster.master_port = netns.DEFAULT_MASTER_PORT + i  # a fresh rendezvous port per run
            if label not in todo:
                column[label] = {"skipped": "-"}
                continue
            print(
                f"[demo] {label}: {steps} steps across 2 emulated nodes at {cap_mbit:g} Mbit/s ...",
                flush=True,
            )
            progress.start()
            column[label] = run_on_cluster(cluster, by_label[label], steps, workdir, extra)
            if "error" in column[label]:
                print(f"[demo] {label} across nodes FAILED\n{column[label]['error']}", flush=True)
            progress.finish(label, "FAILED" if "error" in column[label] else "done")
    return column


def format_table(
    rows: list[tuple[str, dict]], capped: Optional[dict[str, dict]] = None, capped_title: str = "capped"
) -> str:
    """The demo table; with ``capped`` (label -> result across emulated nodes) one more column."""
    extra_head = f" {capped_title:>18} |" if capped is not None else ""
    header = f"| {'strategy':<36} | {'median step':>11} | {'bytes sent/step':>15} | {'final val loss':>14} |"
    lines = [
        header + extra_head,
        "|" + "-" * 38 + "|" + "-" * 13 + "|" + "-" * 17 + "|" + "-" * 16 + "|"
        + ("-" * 20 + "|" if capped is not None else ""),
    ]  # fmt: skip
    for label, r in rows:
        if "error" in r or "skipped" in r:
            note = r.get("skipped") or "failed (see above)"
            lines.append(f"| {label:<36} | {note:>49} |" + (f" {'-':>18} |" if capped is not None else ""))
            continue
        sent = "not counted" if r.get("strategy") == "ddp" else f"{int(r['bytes_sent_per_step']):,}"
        cell = ""
        if capped is not None:
            c = capped.get(label, {})
            if "median_step_s" in c:
                cell = f" {c['median_step_s'] * 1000:>15.1f} ms |"
            else:
                cell = f" {'failed' if 'error' in c else '-':>18} |"
        lines.append(
            f"| {label:<36} | {r['median_step_s'] * 1000:>8.1f} ms | {sent:>15} | "
            f"{r['final_val_loss']:>14.4f} |" + cell
        )
    return "\n".join(lines)


CAPPED_STEPS = 10
"""Steps of each run across the emulated nodes (the first 3 are warm-up): enough for a median."""


def main(steps: int = 100, extra: Optional[list[str]] = None, cap_mbit: float = 100.0) -> int:
    extra = extra or []
    if not cap_mbit >= 0:
        raise ValueError(f"cap_mbit={cap_mbit!r} must be >= 0 (0: no capped-link column)")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as workdir:
        runs = [(run, _available(run)) for run in demo_runs()]
        for run, reason in runs:
            if reason:
                print(f"[demo] {run.label}: {reason}", flush=True)
        trainable = [run for run, reason in runs if not reason]
        progress = Progress(len(trainable))

        def done(run: DemoRun, result: dict) -> None:
            if "error" in result:
                print(f"[demo] {run.label} FAILED\n{result['error']}", flush=True)
            progress.finish(run.label, "FAILED" if "error" in result else "done")
            progress.start()
            results[run.label] = result

        for launcher in dict.fromkeys(tuple(run.launcher) for run in trainable):
            group = [run for run in trainable if tuple(run.launcher) == launcher]
            print(
                f"[demo] training {steps} steps on 2 processes, one row after another in one launch: "
                + ", ".join(run.label for run in group),
                flush=True,
            )
            progress.start()
            run_rows(group, steps, workdir, extra, done)
        rows = [(run.label, results.get(run.label, {"skipped": reason})) for run, reason in runs]
        failed = any("error" in result for result in results.values())
        capped = None
        cap_steps = min(steps, CAPPED_STEPS)
        if cap_mbit > 0:
            capped = capped_column(rows, cap_steps, workdir, extra, cap_mbit)
            failed = failed or any("error" in r for r in (capped or {}).values())
    print()
    print(f"Embedded workload (stdlib byte LM), {steps} optimizer steps, 2 CPU processes, Gloo:")
    print(format_table(rows, capped, f"{cap_mbit:g} Mbit x 2 nodes"))
    print(
        "bytes sent/step: per rank, from lightning_dist.collectives counters (wire model: ring all-reduce);"
    )
    print(
        "Lightning's own DDPStrategy does not go through them. Step times are medians after 3 warm-up steps."
    )
    if capped is not None:
        print(
            f"{cap_mbit:g} Mbit x 2 nodes: median step of a {cap_steps}-step run (first 3 steps not timed), one process in "
            f"each of 2 network namespaces joined by a veth pair capped at {cap_mbit:g} Mbit/s per direction "
            "(tc tbf); benchmarks/bench_cluster.py measures every cap and the references."
        )
    return 1 if failed else 0


if __name__ == "__main__":
    train_rows(json.loads(sys.argv[1]))
