"""Sharded training across 2 emulated nodes: memory per rank, bytes across the link, step time, loss.

    python benchmarks/bench_sharded.py                                   # root: 2 nodes x 2 ranks, 1 Gbit/s, 100 Mbit/s
    python benchmarks/bench_sharded.py --rounds 1 --caps 1gbit 100mbit   # quick (the docs' table)
    python benchmarks/bench_sharded.py --same-host                       # no namespaces: 4 ranks on this host
    python benchmarks/bench_sharded.py --rounds 5 --caps 1gbit none --rows fsdp2 sharded sharded_int8 hsdp_int8 \
        --timeline /tmp/traces                                           # the targets, and one Timeline per row
    python benchmarks/bench_sharded.py --accelerator gpu --ranks 2 --rows fsdp2 sharded sharded_int8   # 2 ranks, 1 GPU

Four ranks: two emulated nodes (``lightning_dist.cluster.netns.EmulatedCluster``: network namespaces
joined by a veth pair, ``tc tbf`` per direction for a cap) with two processes x 1 thread each; rank
r = 2 x node + local rank. HSDP and DiLoCo rows put one replica group on each node (shards inside a
node, replicas across the link), the FSDP rows shard over all four ranks. The model is the embedded
workload (the byte-level LM, AdamW, 16 x 128 tokens per rank, the pack's default per-layer
``fully_shard`` policy; Lightning's ``ModelParallelStrategy`` gets the same ``fully_shard`` calls from
``configure_model``). Each run trains ``--warmup`` + ``--steps`` optimizer steps (defaults 2 + 30: a
multiple of DiLoCo's H=32, so its one sync falls in the timed steps and the loss is at a synced model).

Rows: ``DDP()`` (the memory reference: full replicas), Lightning's FSDP2 (``ModelParallelStrategy``,
fp32: the bytes and time reference), ``Sharded()``, ``Sharded("int8")`` (int8 reduce-scatter),
HSDP ``Sharded(replicas=2, replica_sync="int8" / "powersgd")``, and ``ShardedDiLoCo(inner_steps=32,
replicas=2)`` uncompressed and with int8 pseudo-gradients.

Per row and cap: rank 0's bytes held for training (parameters, gradients, optimizer state, DiLoCo's
last-sync copy and outer momentum; DTensors by their local shard) against ``DDP()``'s; the median step
time over every timed step of every round against Lightning FSDP2's at the same cap; the bytes node 0
sent across the link per timed step (its veth's tx bytes, headers included: what crosses between the
nodes; read after a barrier at either end of the timed steps) and the pack's counted bytes (every
collective of rank 0, inside the node too); the loss on 4 fixed validation batches after training,
against Lightning FSDP2's. ``--same-host`` runs the 4 ranks as plain processes on this machine (no caps:
loopback), for where namespaces are not available. ``--ranks N`` runs N processes on this host under
torchrun, each with one device of ``--accelerator`` (``gpu``: the same one GPU for every rank, so Gloo,
with CUDA tensors, carries both strategies' collectives when N > 1, and NCCL at N = 1), no caps.

Where the time goes: rank 0's median forward (batch start to backward), backward (to the end of
``loss.backward()``, every gradient collective landed) and the rest (optimizer step, gradient
clipping, hooks) per step, and for the pack's rows the seconds per step during which at least one of
its collectives was in flight (``CommStats.busy_seconds``: where it exceeds backward + forward
communication overlapped compute). ``--timeline DIR`` also writes a Timeline (Chrome trace of every
rank's step phases and the pack's collectives; Lightning FSDP2's collectives are torch's own and not
in it) of each row's first-round run, ``DIR/<cap>.<row>.json``.

Targets (``TARGETS``: a row's median step against Lightning FSDP2's at the same cap, in the same
run): each is judged on the pooled medians and on the median of the per-round ratios (rows of one
round run back to back, so a shared machine's drift cancels more in the latter); the ratio of each
row's quietest round (lowest run median) is printed too, the least disturbed estimate where other
jobs share the machine.
Writes OUT/sharded.md and OUT/sharded.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from bench_cluster import Row, _bytes, _env, _ms, _tx_bytes, cap_label, checked_counts, parse_cap, summarize

BENCH_DIR = Path(__file__).resolve().parent


ROWS: dict[str, Row] = {  # kind: "ddp", "fsdp2" (Lightning's ModelParallelStrategy), "sharded", "sharded_diloco"
    r.key: r
    for r in [
        Row("ddp", "DDP() (memory reference)", "ddp"),
        Row("fsdp2", "Lightning FSDP2, fp32 (reference)", "fsdp2"),
        Row("sharded", "Sharded()", "sharded"),
        Row("sharded_int8", "Sharded('int8')", "sharded", options={"compression": "int8"}),
        Row("hsdp_int8", "Sharded(replicas=2, replica_sync='int8')", "sharded", options={"replicas": 2, "replica_sync": "int8"}),
        Row("hsdp_powersgd", "Sharded(replicas=2, replica_sync='powersgd')", "sharded",
            options={"replicas": 2, "replica_sync": "powersgd"}),
        Row("diloco", "ShardedDiLoCo(inner_steps=32, replicas=2)", "sharded_diloco", options={"inner_steps": 32, "replicas": 2}),
        Row("diloco_int8", "ShardedDiLoCo(inner_steps=32, replicas=2, compression='int8')", "sharded_diloco",
            options={"inner_steps": 32, "replicas": 2, "compression": "int8"}),
    ]
}  # fmt: skip
MEMORY_REFERENCE = "ddp"
REFERENCE = "fsdp2"
NODES, PER_NODE = 2, 2
TARGETS: dict[tuple[str, Optional[float]], float] = {
    ("sharded", 1000.0): 1.02,
    ("sharded", None): 1.02,
    ("sharded_int8", 1000.0): 1.0,
    ("hsdp_int8", 1000.0): 1.0,
}
"""(row, cap in Mbit/s or None for no cap) -> the most its median step may be, as a multiple of
Lightning FSDP2's at that cap (issue 40)."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--caps", nargs="+", type=parse_cap, default=[parse_cap("1gbit"), parse_cap("100mbit")],
                   help="link caps: none, 1gbit, 100mbit, ... (default: 1 Gbit/s and 100 Mbit/s)")  # fmt: skip
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), metavar="ROW",
                   help=f"subset of rows (default all): {', '.join(ROWS)}")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first in each run (default 2)")
    p.add_argument("--same-host", action="store_true", help="4 plain processes on this host, no caps")
    p.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="N processes on this host under torchrun, one --accelerator device each (shared), no caps",
    )
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: every rank on the one GPU (needs --ranks; Gloo when --ranks > 1)")  # fmt: skip
    p.add_argument(
        "--out", default=str(BENCH_DIR / "results"), help="output folder (default benchmarks/results)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="write a Timeline of each row's first-round run to DIR/<cap>.<row>.json")  # fmt: skip
    p.add_argument("--timeline-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    a = checked_counts(p, p.parse_args(argv))
    if a.ranks < 0 or (a.accelerator == "gpu" and a.ranks < 1):
        p.error(f"--ranks={a.ranks}: give --ranks 1 or more (needed with --accelerator gpu)")
    if a.ranks and a.same_host:
        p.error("--ranks and --same-host: give one of them")
    a.caps = [None] if a.same_host or a.ranks else list(dict.fromkeys(a.caps))
    return a


def world_size(a: argparse.Namespace) -> int:
    return a.ranks or NODES * PER_NODE


def _backend(a: argparse.Namespace) -> dict[str, str]:
    """Ranks sharing one GPU talk over Gloo (NCCL refuses two ranks on one device)."""
    return {"process_group_backend": "gloo"} if a.accelerator == "gpu" and a.ranks > 1 else {}


# -- the worker: one rank of one run ------------------------------------------------------------------


def _strategy(row: Row, a: argparse.Namespace) -> Any:
    import lightning_dist

    backend = _backend(a)
    if row.kind == "ddp":
        return lightning_dist.DDP(**backend)
    if row.kind == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=world_size(a), tensor_parallel_size=1, **backend)
    if row.kind == "sharded_diloco":
        return lightning_dist.ShardedDiLoCo(**row.options, **backend)
    return lightning_dist.Sharded(**row.options, **backend)


def _module(row: Row) -> Any:
    import torch
    from typing_extensions import override

    from lightning_dist.layout.sharding_policy import shard_by_layer
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.data import TextBlocks, load_corpus

    class ShardLM(TinyCausalLM):
        """The workload without its per-step ``sync_dist`` log; for Lightning's FSDP2 its
        ``configure_model`` applies the pack's default per-layer policy (the other rows leave it)."""

        @override
        def configure_model(self) -> None:
            if row.kind == "fsdp2":
                shard_by_layer(self, self.device_mesh["data_parallel"])

        @override
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self._loss(batch)[0]

        def eval_loss(self) -> float:
            """Mean loss on 4 fixed validation batches (every rank: a sharded forward is a collective)."""
            data = TextBlocks(load_corpus("val", self.config.val_bytes), self.config.seq_len)
            loader = torch.utils.data.DataLoader(data, batch_size=self.config.batch_size)
            self.eval()
            with torch.no_grad():
                losses = [
                    float(self._loss([t.to(self.device) for t in b])[0]) for b, _ in zip(loader, range(4))
                ]
            return sum(losses) / len(losses)

    return ShardLM(WorkloadConfig(seed=1234))


def worker(a: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from meters import StateBytes, StepMeter

    from lightning_dist import collectives
    from lightning_dist.workload.trainer import quiet_trainer

    torch.set_num_threads(1)
    row = ROWS[a.worker]
    if a.ranks:  # under torchrun: each rank one node of one device (the same GPU for all)
        os.environ.update(GROUP_RANK=os.environ["RANK"], LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")

    class Phases(L.Callback):
        """Per step: forward, backward (``loss.backward()``, every gradient landed), the rest, and
        the seconds the pack's collectives were in flight (its counters; None for Lightning's)."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Optional[float]]] = []
            self._marks: list[float] = []
            self._busy = 0.0

        def _comm_busy(self, trainer: Any) -> Optional[float]:
            comm = getattr(trainer.strategy, "communicator", None)
            return None if comm is None else float(comm.stats.busy_seconds)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            self._marks = [time.perf_counter()]
            self._busy = self._comm_busy(trainer) or 0.0

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._marks.append(time.perf_counter())

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._marks.append(time.perf_counter())

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            start, fwd_end, bwd_end, end = [*self._marks, time.perf_counter()][:4]
            busy = self._comm_busy(trainer)
            self.steps.append({
                "forward": fwd_end - start, "backward": bwd_end - fwd_end, "rest": end - bwd_end,
                "comm_busy": None if busy is None else busy - self._busy,
            })  # fmt: skip

    class Wire(L.Callback):
        """Node 0's tx bytes at the start and the end of the timed steps, each after a barrier: the
        other local rank's exchanges (DiLoCo's sync with its own replica peer) are done by then."""

        def __init__(self) -> None:
            self.marks: list[int] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == a.warmup:
                trainer.strategy.barrier()
                self.marks.append(_tx_bytes())

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            if idx == a.warmup + a.steps - 1:
                trainer.strategy.barrier()
                self.marks.append(_tx_bytes())

    L.seed_everything(1234, verbose=False)
    module = _module(row)
    meter, memory, wire, phases = StepMeter(), StateBytes(), Wire(), Phases()
    timeline: list[Any] = []
    if a.timeline_out:
        from lightning_dist.callbacks import Timeline

        timeline = [Timeline(a.timeline_out)]
    if a.ranks:
        devices, num_nodes = 1, a.ranks
    else:
        devices, num_nodes = (NODES * PER_NODE, 1) if a.same_host else (PER_NODE, NODES)
    trainer = quiet_trainer(
        accelerator=a.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=_strategy(row, a),
        max_steps=a.warmup + a.steps,
        limit_val_batches=0,
        callbacks=[meter, memory, wire, phases, *timeline],
    )
    trainer.fit(module)
    loss = module.eval_loss()
    timed = slice(a.warmup, a.warmup + a.steps)
    counted = meter.step_bytes[timed]
    result = {
        "rank": trainer.global_rank,
        "step_seconds": meter.step_seconds[timed],
        "counted_bytes": sum(counted) / len(counted) if row.kind != "fsdp2" else None,
        "wire_bytes": (wire.marks[1] - wire.marks[0]) / a.steps
        if len(wire.marks) == 2 and not (a.same_host or a.ranks)
        else None,
        "loss": loss,
        "memory": memory.summary(),
        "phases": phases.steps[timed],
    }
    if trainer.global_rank == 0 and a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(result, fh)
    collectives.shutdown()


# -- the driver ---------------------------------------------------------------------------------------


def launch(
    cluster: Any, row: Row, a: argparse.Namespace, out: str, port: int, trace: Optional[str] = None
) -> dict[str, Any]:
    """One run of ``row`` on the 4 ranks (with a Timeline to ``trace``); rank 0's result or {'error': ...}."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", row.key, "--json-out", out,
            "--steps", str(a.steps), "--warmup", str(a.warmup)] + (["--same-host"] if a.same_host else [])  # fmt: skip
    if a.ranks:
        argv[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}", argv[1]]
        argv += ["--ranks", str(a.ranks), "--accelerator", a.accelerator]
    if trace:
        argv += ["--timeline-out", trace]
    if os.path.exists(out):
        os.remove(out)
    env = _env()
    try:
        if cluster is None:
            if not a.ranks:  # torchrun --standalone picks its own
                env["MASTER_PORT"] = str(port)
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
            code, tail = proc.returncode, proc.stderr[-3000:]
        else:
            cluster.master_port = port
            results = cluster.run_each(argv, timeout=a.timeout, env=env)
            code = max(abs(r.returncode) for r in results)
            tail = "\n".join(f"--- node {i} ---\n{r.stderr[-1500:]}" for i, r in enumerate(results))
    except (TimeoutError, subprocess.TimeoutExpired) as err:
        code, tail = 124, str(err)[-3000:]
    if code != 0 or not os.path.exists(out):
        return {"error": f"exit {code}\n{tail}"}
    with open(out) as fh:
        return dict(json.load(fh))


def _memory_table(runs: dict[str, dict[str, list[dict[str, Any]]]], rows: Sequence[str]) -> list[str]:
    first = {k: next((r for c in runs.values() for r in c.get(k, []) if "memory" in r), None) for k in rows}
    ref = first.get(MEMORY_REFERENCE)
    ref_total = sum(ref["memory"][k] for k in ("params", "grads", "optimizer")) if ref else None
    out = [
        "| row | parameters | gradients | optimizer state | p + g + o | vs DDP() | + strategy state | total vs DDP() |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in rows:
        r = first[key]
        if r is None:
            out.append(f"| {ROWS[key].label} | failed | | | | | | |")
            continue
        m = r["memory"]
        pgo = m["params"] + m["grads"] + m["optimizer"]
        ratio = f"{pgo / ref_total:.3f}" if ref_total else "-"
        total = f"{(pgo + m['strategy']) / ref_total:.3f}" if ref_total else "-"
        cells = [_bytes(m["params"]), _bytes(m["grads"]), _bytes(m["optimizer"]), _bytes(pgo), ratio,
                 _bytes(m["strategy"]), total]  # fmt: skip
        out.append(f"| {ROWS[key].label} | " + " | ".join(cells) + " |")
    return out


def _time_table(
    summary: dict[str, dict[str, Any]], caps: Sequence[Optional[float]], rows: Sequence[str]
) -> list[str]:
    out = [
        "| row | cap | median step | vs FSDP2 | bytes/step across the link | FSDP2 / row | counted bytes/step "
        "| loss | vs FSDP2 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cap in caps:
        ref = summary[cap_label(cap)].get(REFERENCE, {})
        for key in rows:
            s = summary[cap_label(cap)].get(key, {})
            if "median_s" not in s:
                out.append(f"| {ROWS[key].label} | {cap_label(cap)} | failed | | | | | | |")
                continue
            t = f"{s['median_s'] / ref['median_s']:.2f}x" if "median_s" in ref else "-"
            wire, ref_wire = s.get("wire_bytes"), ref.get("wire_bytes")
            fewer = f"{ref_wire / wire:.0f}x" if wire and ref_wire else "-"
            loss = s.get("loss")
            dl = f"{(loss / ref['loss'] - 1) * 100:+.1f}%" if loss is not None and ref.get("loss") else "-"
            out.append(
                f"| {ROWS[key].label} | {cap_label(cap)} | {_ms(s['median_s'])} ms | {t} | {_bytes(wire)} | {fewer} "
                f"| {_bytes(s.get('counted_bytes'))} | {'-' if loss is None else f'{loss:.4f}'} | {dl} |"
            )
    return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _phase_table(
    runs: dict[str, dict[str, list[dict[str, Any]]]], caps: Sequence[Optional[float]], rows: Sequence[str]
) -> list[str]:
    """Median ms per step of rank 0's phases over every timed step of every round."""
    out = [
        "| row | cap | forward | backward | rest (optimizer, hooks) | pack's collectives in flight |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for cap in caps:
        for key in rows:
            steps = [p for r in runs.get(cap_label(cap), {}).get(key, []) for p in r.get("phases", [])]
            if not steps:
                continue

            def ms(name: str, steps: list[dict[str, Any]] = steps) -> str:
                values = [p[name] for p in steps if p.get(name) is not None]
                return f"{_median(values) * 1000:.1f} ms" if values else "-"

            cells = [ms("forward"), ms("backward"), ms("rest"), ms("comm_busy")]
            out.append(f"| {ROWS[key].label} | {cap_label(cap)} | " + " | ".join(cells) + " |")
    return out


def _round_ratios(runs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> list[float]:
    """Per round (the i-th run of each), the row's median step over the reference's."""
    return [
        _median(r["step_seconds"]) / _median(f["step_seconds"])
        for r, f in zip(runs, refs)
        if "error" not in r and "error" not in f
    ]


def _targets(
    summary: dict[str, dict[str, Any]],
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    caps: Sequence[Optional[float]],
    rows: Sequence[str],
) -> list[str]:
    """One line per target of ``TARGETS`` this run measured: both ratios and whether they meet it."""
    out = []
    for (key, cap), bound in TARGETS.items():
        label = cap_label(cap)
        if key not in rows or REFERENCE not in rows or cap not in caps:
            continue
        s, ref = summary[label].get(key, {}), summary[label].get(REFERENCE, {})
        if "median_s" not in s or "median_s" not in ref:
            out.append(f"- {ROWS[key].label} at {label}: failed (target <= {bound:.2f}x)")
            continue
        pooled = s["median_s"] / ref["median_s"]
        per_round = _round_ratios(runs[label][key], runs[label][REFERENCE])
        rounds = _median(per_round) if per_round else float("nan")
        best = min(s["round_medians_s"]) / min(ref["round_medians_s"])
        verdict = (
            "met"
            if max(pooled, rounds) <= bound
            else ("met on one of the two" if min(pooled, rounds) <= bound else "missed")
        )
        out.append(
            f"- {ROWS[key].label} at {label}: {pooled:.3f}x pooled, {rounds:.3f}x median of {len(per_round)} "
            f"per-round ratios ({', '.join(f'{r:.2f}' for r in per_round)}), {best:.3f}x of the quietest "
            f"rounds; target <= {bound:.2f}x: {verdict}"
        )
    return out


def drive(a: argparse.Namespace, argv: Sequence[str]) -> int:
    import contextlib

    import torch
    from machine_info import machine

    from lightning_dist.cluster import netns

    where = "4 processes on this host (loopback)"
    if a.ranks:
        device = "the one GPU" if a.accelerator == "gpu" else "the CPU"
        transport = "Gloo, CUDA tensors" if a.accelerator == "gpu" and a.ranks > 1 else "default backend"
        where = f"{a.ranks} process(es) on this host under torchrun, sharing {device} ({transport})"
    elif not a.same_host:
        reason = netns.unavailable_reason(rate_limited=any(c is not None for c in a.caps))
        if reason is not None:
            print(f"bench_sharded: cannot emulate nodes: {reason}; rerun with --same-host", file=sys.stderr)
            return 2
        where = "2 emulated nodes (network namespaces, veth, tc tbf per direction) x 2 processes"
    rows = [ROWS[k] for k in a.rows]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started, port, done = time.monotonic(), 29600, 0
    total = len(a.caps) * a.rounds * len(rows)
    command = "python benchmarks/bench_sharded.py " + " ".join(argv)
    print(f"command: {command}\n{total} runs", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for cap in a.caps:
            local = a.same_host or a.ranks
            cm = contextlib.nullcontext(None) if local else netns.EmulatedCluster(NODES, rate_mbit=cap)
            with cm as cluster:
                for rnd in range(a.rounds):
                    shift = (rnd * 3) % len(rows)
                    for row in rows[shift:] + rows[:shift]:
                        t0, port = time.monotonic(), 29600 + (port - 29599) % 300
                        trace = None
                        if a.timeline and rnd == 0:
                            os.makedirs(a.timeline, exist_ok=True)
                            trace = os.path.join(
                                a.timeline,
                                f"{cap_label(cap).replace(' ', '').replace('/', '')}.{row.key}.json",
                            )
                        res = launch(cluster, row, a, os.path.join(tmp, "r.json"), port, trace)
                        runs.setdefault(cap_label(cap), {}).setdefault(row.key, []).append(res)
                        done += 1
                        head = (
                            f"[{done}/{total} {time.monotonic() - started:.0f}s] {cap_label(cap)} {row.label}"
                        )
                        if "error" in res:
                            print(f"{head}: FAILED\n{res['error']}", flush=True)
                        else:
                            print(f"{head}: step {_ms(summarize([res])['median_s'])} ms, link "
                                  f"{_bytes(res['wire_bytes'])}/step, loss {res['loss']:.4f}, run "
                                  f"{time.monotonic() - t0:.0f}s", flush=True)  # fmt: skip
    summary = {c: {k: summarize(v) for k, v in by_row.items()} for c, by_row in runs.items()}
    header = [
        f"machine: {machine()}",
        f"torch {torch.__version__}; {where}, 1 thread each; {a.rounds} round(s) x {a.steps} timed steps "
        f"after {a.warmup} warm-up",
        f"command: {command}",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; took {time.monotonic() - started:.0f} s",
    ]
    text = "\n".join([
        "## Sharded training: memory, bytes across the link, step time", "", *[f"{h}  " for h in header], "",
        "Bytes held per rank for training (rank 0):", "", *_memory_table(runs, a.rows), "",
        "Step time, bytes and loss:", "", *_time_table(summary, a.caps, a.rows), "",
        "Where the time goes (rank 0, median per step):", "", *_phase_table(runs, a.caps, a.rows), "",
        "Targets (issue 40), against Lightning FSDP2 in this run:", "", *(_targets(summary, runs, a.caps, a.rows) or ["- none measured (needs the fsdp2 row)"]), "",
    ])  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded.md").write_text(text)
    (out / "sharded.json").write_text(
        json.dumps({"header": header, "summary": summary, "runs": runs}, indent=1)
    )
    print()
    print(text)
    print(f"wrote {out / 'sharded.md'}, {out / 'sharded.json'}")
    return 1 if any("error" in r for c in runs.values() for v in c.values() for r in v) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.worker is None:
        return drive(a, argv)
    worker(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
