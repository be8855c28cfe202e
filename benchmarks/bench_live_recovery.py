"""FaultTolerant (live recovery on torchft) against Elastic (torchrun restarts) on the embedded workload.

    python benchmarks/bench_live_recovery.py                  # 2 replica groups x 1 CPU process, Gloo
    python benchmarks/bench_live_recovery.py --steps 40 --rounds 3 --kill-step 10 --table out.md
    python benchmarks/bench_live_recovery.py --nodes 2        # group g on emulated node g (root)

Launches of this script, the same global batch (2 x WorkloadConfig().batch_size) throughout:

rounds    ``--rounds`` x (ft, elastic), interleaved (FT, Elastic, FT, Elastic, ...) so that a change
          of the machine's load hits both alike. ft: two replica groups (one torchrun each, as
          ``lightning_dist.launch.fault_tolerant`` starts them) with ``FaultTolerant``, no fault.
          elastic: ``torchrun --nproc-per-node=2`` (``--nnodes=2`` across nodes) with ``Elastic``
          and no commit in the run. Quorum overhead: the median over the rounds of FT / Elastic
          mean step (target <= 1.05), with the rounds' range.
kill      ft again, group 1 SIGKILLs itself at the start of step ``--kill-step`` and its torchrun
          restarts it (through the group's warm standby; ``--restarts cold``: a fresh Python;
          ``warm,cold``: both, back to back). Steps
          redone: committed steps that were committed again (target 0); the step in flight at the
          kill is not committed and runs again (reported apart). The healthy group's slowest step
          from the kill until group 1 is back, over its median step before the kill; detection: from
          the kill to the healthy group's next committed step (target: under a second beyond one
          step). Rejoin: from
          the kill to the first step committed by both groups again (target < 5 s), and where its
          seconds went (timestamps the restarted worker takes at each stage).

Step times are the gaps between consecutive committed steps (``time.time()`` at each step's end),
over steps after ``--warmup``; a round's figure is a mean, as one step in N carries the quorum.
``--nodes 2`` builds ``lightning_dist.cluster.netns.EmulatedCluster(2)`` (network namespaces joined
by a veth link, ``--rate-mbit`` caps it): group g and Elastic's rank g run on node g, the Lighthouse
(``torchft_lighthouse``) on node 0. Prints the machine and the tables; ``--table`` writes them too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from fit_args import fit_parser  # benchmarks/ is on sys.path when a benchmark runs
from machine_info import machine, markdown_table

STARTED = time.time()
"""When this process started running Python code (before torch, Lightning and torchft are imported)."""
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = fit_parser(__doc__, rounds_help="interleaved no-fault rounds (FT, Elastic) x N")
    p.add_argument("--kill-step", type=int, default=10, help="group 1 is killed at the start of this step")
    p.add_argument(
        "--nodes",
        type=int,
        choices=[1, 2],
        default=1,
        help="2: group g and Elastic's rank g on emulated node g (root; network namespaces)",
    )
    p.add_argument("--rate-mbit", type=float, default=None, help="with --nodes 2: cap the link (Mbit/s)")
    p.add_argument(
        "--restarts",
        default="warm",
        help="the kill run's restarts: warm (the groups' standby), cold (a fresh Python) or warm,cold",
    )
    p.add_argument("--worker", choices=["elastic", "ft"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- workers ---------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from lightning_dist import Elastic, FaultTolerant
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    group = int(os.environ.get("REPLICA_GROUP_ID", os.environ.get("RANK", "0")))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rows: list[dict[str, Any]] = []
    marks: dict[str, float] = {"started": STARTED, "imported": time.time()}

    class Clock(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            marks.setdefault("setup", time.time())

        def on_fit_start(self, trainer: L.Trainer, *rest: Any) -> None:
            marks.setdefault("fit_start", time.time())

        def on_before_backward(self, trainer: L.Trainer, *rest: Any) -> None:
            marks.setdefault("first_forward", time.time())  # after the first quorum and the heal

        def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
            marks.setdefault("train_start", time.time())
            if args.kill and attempt == 0 and group == 1 and trainer.global_step == args.kill_step:
                (args.out / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            committed = getattr(trainer.strategy, "committed", None)
            if committed is not None:  # FaultTolerant: the steps its quorums committed
                for rec in committed[len(rows) :]:
                    rows.append({"step": rec.step, "t": time.time(), "participants": rec.participants})
            elif not rows or rows[-1]["step"] != trainer.global_step - 1:
                rows.append({"step": trainer.global_step - 1, "t": time.time(), "participants": 2})

    torch.set_num_threads(1)
    L.seed_everything(1234, verbose=False)
    config = WorkloadConfig()
    if args.worker == "ft":
        strategy: Any = FaultTolerant(replica_groups=2, global_batch=2 * config.batch_size, commit_every=0)
        devices = 1
    else:
        strategy = Elastic(commit_every=args.steps + 1, dirpath=args.out / "commits")
        devices = 2 // args.nodes
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=args.nodes if args.worker == "elastic" else 1,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        default_root_dir=args.out,
        callbacks=[Clock()],
    )
    trainer.fit(TinyCausalLM(config))
    uncommitted = getattr(strategy, "uncommitted_steps", 0)
    with open(args.out / f"steps_{group}_{attempt}.json", "w") as fh:
        json.dump({"rows": rows, "uncommitted": uncommitted, "marks": marks}, fh)


# -- the driver ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RUST_LOG": "warn",  # the Lighthouse's per-quorum log lines
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def _script(args: argparse.Namespace, mode: str, out: Path, kill: bool = False) -> list[str]:
    cmd = [str(Path(__file__).resolve()), "--worker", mode, "--out", str(out), "--steps", str(args.steps)]
    return (
        cmd + ["--kill-step", str(args.kill_step), "--nodes", str(args.nodes)] + (["--kill"] if kill else [])
    )


class OneBox:
    """Both groups (and both Elastic ranks) on this machine."""

    where = "this machine"

    def elastic(self, script: list[str]) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", *script]  # fmt: skip
        subprocess.run(
            cmd, env=_env(), cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    @contextlib.contextmanager
    def lighthouse(self) -> Iterator[str]:
        from lightning_dist.launch.fault_tolerant import Lighthouse

        with Lighthouse() as lighthouse:  # the launcher's heartbeat timeout (HEARTBEAT_TIMEOUT_MS)
            yield lighthouse.address

    def groups(self, script: list[str], lighthouse: str, warm: bool) -> list[subprocess.Popen[Any]]:
        from lightning_dist.launch.fault_tolerant import start_groups

        return start_groups(
            script, 2, lighthouse, max_restarts=1, env=_env(), warm=warm,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip


class TwoNodes(OneBox):
    """Group g (Elastic's rank g) on emulated node g (``EmulatedCluster``: network namespaces, a
    veth link, uncapped unless ``--rate-mbit``); the Lighthouse on node 0."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.where = f"2 emulated nodes ({cluster!r})"

    def elastic(self, script: list[str]) -> None:
        def argv(node: Any) -> list[str]:
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                    f"--node-rank={node.rank}", f"--master-addr={node.master_addr}",
                    f"--master-port={self.cluster.master_port}", "--max-restarts=0", *script]  # fmt: skip

        results = self.cluster.run_each(argv, timeout=1800, env=_env())
        if any(r.returncode for r in results):
            raise SystemExit(f"bench_live_recovery: Elastic failed on the nodes: {results[0].stderr[-3000:]}")

    @contextlib.contextmanager
    def lighthouse(self) -> Iterator[str]:
        from lightning_dist.collectives.fault_tolerant_timeouts import HEARTBEAT_TIMEOUT_MS

        node = self.cluster.nodes[0]
        bind = f"{node.address}:{LIGHTHOUSE_PORT}"
        proc = self.cluster.popen(
            0, [str(Path(sys.executable).with_name("torchft_lighthouse")), "--bind", bind, "--min_replicas", "1",
                "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)],
            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield f"http://{bind}"
        finally:
            proc.terminate()
            proc.wait()

    def groups(self, script: list[str], lighthouse: str, warm: bool) -> list[subprocess.Popen[Any]]:
        from lightning_dist.launch.fault_tolerant import group_command, group_env

        return [
            self.cluster.popen(
                node.rank,
                group_command(script, max_restarts=1, warm=warm),
                env=group_env(node.rank, lighthouse, node.address, _env()),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for node in self.cluster.nodes
        ]


LIGHTHOUSE_PORT = 29510


def run_elastic(args: argparse.Namespace, place: OneBox, out: Path) -> None:
    place.elastic(_script(args, "elastic", out))


def run_ft(args: argparse.Namespace, place: OneBox, out: Path, kill: bool, warm: bool = True) -> None:
    from lightning_dist.launch.fault_tolerant import stop_groups

    with place.lighthouse() as lighthouse:
        procs = place.groups(_script(args, "ft", out, kill), lighthouse, warm=warm)
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            stop_groups(procs)
    if any(codes):
        raise SystemExit(f"bench_live_recovery: a replica group failed ({codes})")


def _result(out: Path, group: int, attempt: int) -> dict[str, Any]:
    path = out / f"steps_{group}_{attempt}.json"
    return json.loads(path.read_text()) if path.exists() else {"rows": [], "uncommitted": 0}


def _rows(out: Path, group: int, attempt: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = _result(out, group, attempt)["rows"]
    return rows


def mean_step(rows: list[dict[str, Any]], warmup: int) -> float:
    gaps = [
        b["t"] - a["t"] for a, b in zip(rows, rows[1:]) if a["step"] >= warmup and b["step"] == a["step"] + 1
    ]
    return statistics.fmean(gaps)


def overhead_rounds(args: argparse.Namespace, place: OneBox, tmp: Path) -> list[tuple[float, float]]:
    """(FaultTolerant, Elastic) mean step of each round, the two run back to back in every round
    (interleaved: FT, Elastic, FT, Elastic, ...), so a change of load hits both alike."""
    pairs = []
    for r in range(args.rounds):
        ft_out, elastic_out = tmp / f"ft{r}", tmp / f"elastic{r}"
        run_ft(args, place, ft_out, kill=False)
        run_elastic(args, place, elastic_out)
        pair = (mean_step(_rows(ft_out, 0, 0), args.warmup), mean_step(_rows(elastic_out, 0, 0), args.warmup))
        print(f"round {r + 1}/{args.rounds}: FaultTolerant {1000 * pair[0]:.1f} ms, Elastic "
              f"{1000 * pair[1]:.1f} ms, ratio {pair[0] / pair[1]:.3f}", flush=True)  # fmt: skip
        pairs.append(pair)
    return pairs


REJOIN_PARTS = [
    ("started", "torchrun notices the death, starts the worker (its Python is running)"),
    ("imported", "imports (torch, Lightning, torchft, the pack)"),
    ("setup", "Trainer and model built, fit starts"),
    ("fit_start", "strategy setup: torchft Manager, servers, commit store"),
    ("train_start", "loop and data set up, first step starts"),
    ("first_forward", "quorum and heal from the peer (to the first backward)"),
]


def rejoin_breakdown(killed_at: float, marks: dict[str, float], back: float) -> list[tuple[str, float]]:
    """Where the seconds from the kill to the restarted group's first step with its peer went."""
    rows, last = [], killed_at
    for key, what in REJOIN_PARTS:
        if key in marks:
            rows.append((what, marks[key] - last))
            last = marks[key]
    rows.append(("first step with the peer committed", back - last))
    rows.append(("kill -> rejoined, total (target < 5 s)", back - killed_at))
    return rows


def kill_figures(args: argparse.Namespace, kill: Path) -> dict[str, Any]:
    """The kill run's figures: steps redone and in flight, the survivor's slowest step, the rejoin."""
    survivor = _rows(kill, 0, 0)
    first, restarted = _rows(kill, 1, 0), _rows(kill, 1, 1)
    killed_at = float((kill / "killed_at").read_text())
    steps = [r["step"] for r in survivor]
    last_before = max((r["step"] for r in first), default=-1)
    back = min((r["t"] for r in restarted if r["participants"] == 2), default=float("nan"))
    pairs = list(zip(survivor, survivor[1:]))
    before = [b["t"] - a["t"] for a, b in pairs if args.warmup <= a["step"] and b["t"] < killed_at]
    until = math.inf if math.isnan(back) else back  # not back before the end: the rest of the run
    during = [b["t"] - a["t"] for a, b in pairs if b["t"] > killed_at and a["t"] < until] or [float("nan")]
    after = [r["t"] for r in survivor if r["t"] > killed_at]
    return {
        "detect": min(after) - killed_at if after else float("nan"),
        "alone": statistics.median(during[1:]) if len(during) > 1 else float("nan"),
        "redone": len(steps) - len(set(steps)) + sum(1 for r in restarted if r["step"] <= last_before),
        "in_flight": _result(kill, 0, 0)["uncommitted"],
        "slowest": max(during),
        "median_before": statistics.median(before),
        "breakdown": rejoin_breakdown(killed_at, _result(kill, 1, 1).get("marks", {}), back),
    }


def _seconds(value: Optional[float]) -> str:
    """A stage's seconds; nan: the restarted group never trained with its peer before the run ended."""
    return "not before the run ended" if value is None or math.isnan(value) else f"{value:.2f} s"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        worker(args)
        return 0
    if not args.warmup + 2 <= args.kill_step < args.steps:
        raise SystemExit("bench_live_recovery: need --warmup + 2 <= --kill-step < --steps")
    modes = args.restarts.split(",")
    if not modes or any(m not in ("warm", "cold") for m in modes):
        raise SystemExit(
            f"bench_live_recovery: --restarts={args.restarts!r}; accepted: warm, cold, warm,cold"
        )
    os.environ.setdefault("RUST_LOG", "warn")  # the in-process Lighthouse's per-quorum log lines
    with contextlib.ExitStack() as stack:
        place = OneBox()
        if args.nodes == 2:
            from lightning_dist.cluster import netns

            place = TwoNodes(stack.enter_context(netns.EmulatedCluster(2, rate_mbit=args.rate_mbit)))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_live_recovery_")))
        print(f"machine: {machine()}\n2 x 1 CPU process (1 thread), Gloo, embedded workload "
              f"(WorkloadConfig()), on {place.where}; restarts: {args.restarts}", flush=True)  # fmt: skip
        pairs = overhead_rounds(args, place, tmp) if args.rounds else []
        kills = {}
        for mode in modes:  # back to back, so the load is alike
            run_ft(args, place, tmp / f"kill_{mode}", kill=True, warm=mode == "warm")
            kills[mode] = kill_figures(args, tmp / f"kill_{mode}")
    rows: list[tuple[str, str, str]] = []
    if pairs:
        ft_med = statistics.median(p[0] for p in pairs)
        el_med = statistics.median(p[1] for p in pairs)
        ratios = sorted(p[0] / p[1] for p in pairs)
        rows += [
            (f"Elastic() mean step, no fault (median of {len(pairs)} rounds)", f"{1000 * el_med:.1f} ms", ""),
            (f"FaultTolerant() mean step, no fault (median of {len(pairs)} rounds)", f"{1000 * ft_med:.1f} ms", ""),
            ("quorum overhead: median of the rounds' FaultTolerant / Elastic (range)",
             f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})", "<= 1.05"),
        ]  # fmt: skip
    for mode, k in kills.items():
        rows += [
            (f"{mode} restart: committed steps redone after the kill at step {args.kill_step}", str(k["redone"]), "0"),
            (f"{mode} restart: steps in flight at the kill, run again (not committed)", str(k["in_flight"]), ""),
            (f"{mode} restart: kill -> healthy group's next committed step (its median step alone after it)",
             f"{k['detect']:.2f} s ({k['alone']:.2f} s)", "< 1 s + a step"),
            (f"{mode} restart: healthy group's slowest step during the failure / its median step before",
             f"{k['slowest'] / k['median_before']:.1f}x ({k['slowest']:.2f} s)", ""),
        ]  # fmt: skip
    stages = [what for what, _ in next(iter(kills.values()))["breakdown"]]
    breakdown = [
        [what, *(_seconds(dict(k["breakdown"]).get(what)) for k in kills.values())] for what in stages
    ]
    table = (
        markdown_table(rows)
        + "\n\n"
        + _table(["kill -> rejoin", *(f"{m} restart" for m in kills)], breakdown)
    )
    print(table)
    if args.table is not None:
        args.table.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
