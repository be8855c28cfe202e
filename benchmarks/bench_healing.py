"""Healing throughput: a killed replica group fetches a >= 1 GB state from its peer over torchft's
live transfer (HTTP on loopback), measured in GB/s, and how soon after it the group trains.

    python benchmarks/bench_healing.py              # --gb 1: a 1 GiB frozen buffer in the model
    python benchmarks/bench_healing.py --gb 2 --kill-step 8 --after 10

Two replica groups on this machine (the Lighthouse in this process, one torchrun each under its warm
standby, as ``lightning_dist.launch.fault_tolerant`` starts them) train the embedded workload
(``TinyCausalLM(WorkloadConfig())``, one CPU process of one thread per group) with
``FaultTolerant(replica_groups=2)``. The model carries a persistent frozen buffer of ``--gb`` GiB
(fp32, seeded random values): it is in the state a healthy group sends, so the transfer is large
while a step stays the workload's. Group 1 SIGKILLs itself at the start of step ``--kill-step``;
its torchrun restarts it (its buffer zero this time, so only the transfer can fill it) and it heals
from group 0. Once it has committed ``--after`` steps with its peer the driver names a stop step.

Timings are the engine's calls, timed in each worker (``ft_recorder.Recorder``): the sender's
``send_checkpoint`` (when its state was staged and served) and the receiver's ``recv_checkpoint``
(the HTTP fetch and its load, ``weights_only``). Transfer: from the later of the fetch's start and
the sender serving the state, to the fetch's end; GB/s = bytes received (every tensor) / those
seconds (target >= 2 GB/s). Then: from the transfer's end to the group's first backward (the
state's check, its load, the first forward) and to its first step committed with the peer, against
the pair's median step (target: the first step within one step time after the transfer). Prints
the machine, the command and a table; writes ``--out``/healing.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine_info import machine, markdown_table  # benchmarks/ is on sys.path when a benchmark runs

STARTED = time.time()
REPO = Path(__file__).resolve().parents[1]
FROZEN = "frozen"
"""The large buffer's name in the model's state dict."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="GiB of frozen state in the model (fp32)")
    p.add_argument("--kill-step", type=int, default=10, help="group 1 is killed at the start of this step")
    p.add_argument("--after", type=int, default=10, help="steps the rejoined group trains before the stop")
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="FaultTolerant(timeout_s=): covers the transfer"
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results", help="where healing.json goes"
    )
    p.add_argument(
        "--keep", type=Path, default=None, help="keep the run's files (logs, rows) in this new folder"
    )
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gb <= 0 or args.kill_step < 3 or args.after < 2:
        p.error("accepted: --gb > 0, --kill-step >= 3, --after >= 2")
    return args


# -- the worker ------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from ft_recorder import Recorder, write_atomic

    from lightning_dist import FaultTolerant
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    out: Path = args.worker
    recorder = Recorder(out, started=STARTED, keep=lambda name: name != FROZEN)
    group, attempt = recorder.group, recorder.attempt
    torch.set_num_threads(1)
    L.seed_everything(1234, verbose=False)

    class Heavy(TinyCausalLM):
        """The workload with a large frozen buffer (state that travels, no gradient)."""

        def __init__(self, config: WorkloadConfig) -> None:
            super().__init__(config)
            n = int(args.gb * (1 << 30)) // 4
            if attempt == 0:  # the state a fresh start has; a restart has only what its peer sends
                frozen = torch.rand(n, generator=torch.Generator().manual_seed(7))
            else:
                frozen = torch.zeros(n)
            self.register_buffer(FROZEN, frozen, persistent=True)

    class Kill(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
            if group == 1 and attempt == 0 and trainer.global_step == args.kill_step:
                write_atomic(out / "killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            probe = getattr(pl_module, FROZEN)[:: 1 << 12].double().sum().item()
            write_atomic(out / f"probe_{group}_{attempt}", repr(probe))

    config = WorkloadConfig()
    strategy = FaultTolerant(
        replica_groups=2, global_batch=2 * config.batch_size, commit_every=0, timeout_s=args.timeout_s
    )
    trainer = quiet_trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=10**7, limit_val_batches=0,
        default_root_dir=out, callbacks=[recorder, Kill()],
    )  # fmt: skip
    trainer.fit(Heavy(config))


# -- the driver ------------------------------------------------------------------------------------


def _rows(out: Path, group: int, attempt: int) -> list[dict[str, Any]]:
    path = out / f"steps_{group}_{attempt}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _marks(out: Path, group: int, attempt: int) -> dict[str, Any]:
    path = out / f"marks_{group}_{attempt}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run(args: argparse.Namespace, out: Path) -> None:
    from lightning_dist.launch.fault_tolerant import Lighthouse, start_groups, stop_groups

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "RUST_LOG": "warn",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    script = [str(Path(__file__).resolve()), "--worker", str(out), "--gb", str(args.gb),
              "--kill-step", str(args.kill_step), "--timeout-s", str(args.timeout_s)]  # fmt: skip
    with Lighthouse(heartbeat_timeout_ms=1000) as lighthouse, open(out / "log.txt", "w") as log:
        procs = start_groups(script, 2, lighthouse.address, max_restarts=1, env=env,
                             stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.time() + 900
            while sum(r["participants"] == 2 for r in _rows(out, 1, 1)) < args.after:
                if time.time() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit(
                        f"bench_healing: group 1 did not rejoin; log:\n{(out / 'log.txt').read_text()[-4000:]}"
                    )
                time.sleep(0.2)
            stop = max(r["step"] for r in _rows(out, 0, 0)) + 3
            (out / "stop").write_text(str(stop))
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=300)
        finally:
            stop_groups(procs)


def figures(out: Path) -> dict[str, Any]:
    received = _marks(out, 1, 1).get("receives", [])
    if not received:
        raise SystemExit("bench_healing: the restarted group received no checkpoint")
    recv = received[0]
    sends = [s for s in _marks(out, 0, 0).get("sends", []) if s["allowed"] <= recv["end"]]
    served = sends[-1]["allowed"] if sends else recv["begin"]
    begin = max(recv["begin"], served)
    seconds = recv["end"] - begin
    rejoined = [r for r in _rows(out, 1, 1) if r["participants"] == 2]
    pair = [r for r in _rows(out, 0, 0) if r["participants"] == 2 and r["t"] > rejoined[0]["t"]]
    steps = [b["t"] - a["t"] for a, b in zip(pair, pair[1:]) if b["step"] == a["step"] + 1]
    median = statistics.median(steps) if steps else float("nan")
    killed = float((out / "killed_at").read_text())
    survivor = _rows(out, 0, 0)
    during = [
        b["t"] - a["t"]
        for a, b in zip(survivor, survivor[1:])
        if b["t"] > begin and a["t"] < recv["end"] + median
    ]
    probes = {
        g: float((out / f"probe_{g}_{a}").read_text())
        for g, a in ((0, 0), (1, 1))
        if (out / f"probe_{g}_{a}").exists()
    }
    return {
        "bytes": recv["bytes"],
        "fetch_s": recv["end"] - recv["begin"],
        "wait_for_sender_s": max(0.0, served - recv["begin"]),
        "transfer_s": seconds,
        "gb_per_s": recv["bytes"] / seconds / 1e9,
        "to_first_backward_s": _marks(out, 1, 1).get("first_backward", float("nan")) - recv["end"],
        "to_first_step_s": rejoined[0]["t"] - recv["end"],
        "median_step_s": median,
        "survivor_step_during_heal_s": max(during, default=float("nan")),
        "kill_to_rejoin_s": rejoined[0]["t"] - killed,
        "frozen_probe_equal": len(probes) == 2 and probes[0] == probes[1],
    }


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        args.worker.mkdir(parents=True, exist_ok=True)
        worker(args)
        return 0
    import torch

    header = [
        f"machine: {machine()}",
        "command: python benchmarks/bench_healing.py " + " ".join(argv),
        f"torch {torch.__version__}; 2 replica groups x 1 CPU process (1 thread) on loopback, warm restarts; "
        f"TinyCausalLM(WorkloadConfig()) + a {args.gb:g} GiB frozen fp32 buffer; group 1 killed at step "
        f"{args.kill_step}",
    ]
    print("\n".join(header), flush=True)
    with contextlib.ExitStack() as stack:
        out = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_healing_")))
        out.mkdir(parents=True, exist_ok=True)
        run(args, out)
        f = figures(out)
    ratio = f["to_first_step_s"] / f["median_step_s"]
    rows = [
        ("state received (every tensor)", f"{f['bytes'] / 1e9:.3f} GB", ">= 1 GB"),
        ("live transfer: seconds (the fetch, less its wait for the sender to serve)",
         f"{f['transfer_s']:.2f} s (fetch {f['fetch_s']:.2f} s, of which waiting {f['wait_for_sender_s']:.2f} s)", ""),
        ("healing throughput", f"{f['gb_per_s']:.2f} GB/s", ">= 2 GB/s"),
        ("transfer end -> the group's first backward (check, load, first forward) / median step",
         f"{f['to_first_backward_s']:.2f} s = {f['to_first_backward_s'] / f['median_step_s']:.1f} step times",
         "<= 1 step time (it starts training)"),
        ("transfer end -> its first step committed with the peer / the pair's median step",
         f"{f['to_first_step_s']:.2f} s / {f['median_step_s']:.3f} s = {ratio:.1f} step times", "<= 1 step time (strict reading)"),
        ("the survivor's slowest step during the heal", f"{f['survivor_step_during_heal_s']:.2f} s", ""),
        ("kill -> rejoined (first step with the peer)", f"{f['kill_to_rejoin_s']:.2f} s", ""),
        ("the restarted group's frozen buffer equals its peer's (it started zero)",
         "yes" if f["frozen_probe_equal"] else "no", "yes"),
    ]  # fmt: skip
    table = markdown_table(rows)
    header.append(
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; took {time.time() - STARTED:.0f} s"
    )
    print(header[-1] + "\n\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "healing.json"
    path.write_text(json.dumps({"header": header, "figures": f, "table": table}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
