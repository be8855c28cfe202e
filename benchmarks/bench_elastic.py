"""Elastic on the embedded workload: commit overhead, recovery time and steps redone after a kill.

    python benchmarks/bench_elastic.py                     # 2 CPU workers under torchrun, Gloo
    python benchmarks/bench_elastic.py --steps 60 --rounds 3 --commit-every 10 --kill-step 25

Two torchrun launches of this script (``--standalone --nproc-per-node=2``):

overhead  the same worker processes fit the workload ``--rounds`` times with ``Elastic(commit_every=N)``
          and with no commit at all (``commit_every`` past the last step), alternating which goes
          first. A round's figure is its mean step time over the steps after ``--warmup`` (a mean,
          not a median, because the commit cost lands on one step in N); the table shows the median
          over rounds, the ratio commits / none (target <= 1.05; also the median of each round's own
          ratio, which cancels slow drifts of a shared machine) and the median time one commit
          holds up training (``Elastic.commit``; the write itself runs in the background).
recovery  ``--max-restarts=1``; rank 1 SIGKILLs itself after step ``--kill-step``. Recovery time is
          from the kill to the first optimizer step completed after the restart (target < 15 s);
          steps redone is the kill step minus the step of the commit resumed from (target <=
          ``--commit-every``).

Prints the machine, the commands, a markdown table, and writes it to ``--table`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fit_args import fit_parser  # benchmarks/ is on sys.path when a benchmark runs
from machine_info import machine, markdown_table

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = fit_parser(__doc__, rounds_help="fits per setting in the overhead run")
    p.add_argument("--commit-every", type=int, default=10, help="optimizer steps between commits")
    p.add_argument("--kill-step", type=int, default=25, help="rank 1 is killed after this step")
    p.add_argument("--worker", choices=["overhead", "recovery"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- workers (run under torchrun) ------------------------------------------------------------------


def _fit(out: Path, commit_every: int, steps: int, on_step: Any) -> Any:
    """One fit of the embedded workload with ``Elastic``; ``on_step(trainer)`` after every step."""
    import lightning as L
    import torch

    from lightning_dist import Elastic
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig
    from lightning_dist.workload.trainer import quiet_trainer

    class StepClock(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            on_step(trainer)

    torch.set_num_threads(1)
    L.seed_everything(1234, verbose=False)
    strategy = Elastic(commit_every=commit_every, dirpath=out / "commits")
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        callbacks=[StepClock()],
    )
    trainer.fit(TinyCausalLM(WorkloadConfig()))
    return strategy


def _timed_commits(durations: list[float]) -> None:
    """Record the duration of every ``Elastic.commit`` call (all ranks take part in one)."""
    from lightning_dist import Elastic

    commit = Elastic.commit

    def timed(self: Any, trainer: Any) -> None:
        start = time.perf_counter()
        commit(self, trainer)
        durations.append(time.perf_counter() - start)

    Elastic.commit = timed  # type: ignore[method-assign]


def overhead_worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    commit_times: list[float] = []
    _timed_commits(commit_times)
    results: dict[str, list[float]] = {"commits": [], "none": []}
    for r in range(args.rounds):
        order = ["commits", "none"] if r % 2 == 0 else ["none", "commits"]
        for mode in order:
            stamps: list[float] = []
            every = args.commit_every if mode == "commits" else args.steps + 1
            _fit(
                args.out / f"round{r}_{mode}",
                every,
                args.steps,
                lambda _t, stamps=stamps: stamps.append(time.perf_counter()),
            )
            gaps = [b - a for a, b in zip(stamps[args.warmup :], stamps[args.warmup + 1 :])]
            results[mode].append(statistics.fmean(gaps))
            if rank == 0:
                print(
                    f"  round {r + 1}/{args.rounds} {mode:>7}: {1000 * results[mode][-1]:.1f} ms/step",
                    flush=True,
                )
    if rank == 0:
        (args.out / "overhead.json").write_text(json.dumps({**results, "commit_times": commit_times}))


def recovery_worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    first_after_restart: list[float] = []

    def on_step(trainer: Any) -> None:
        if attempt == 0 and rank == 1 and trainer.global_step == args.kill_step:
            (args.out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt > 0 and not first_after_restart:
            first_after_restart.append(time.time())

    strategy = _fit(args.out, args.commit_every, args.steps, on_step)
    if rank == 0:
        facts = {
            "attempt": attempt,
            "resumed_from": strategy.resumed_from,
            "first_step_at": first_after_restart[0],
        }
        (args.out / "recovery.json").write_text(json.dumps(facts))


# -- the driver ------------------------------------------------------------------------------------


def torchrun(args: argparse.Namespace, worker: str, out: Path, max_restarts: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        f"--max-restarts={max_restarts}", str(Path(__file__).resolve()), "--worker", worker, "--out", str(out),
        "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
        "--commit-every", str(args.commit_every), "--kill-step", str(args.kill_step),
    ]  # fmt: skip


def run(cmd: list[str]) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    print("$ " + " ".join(cmd[cmd.index("--worker") - 1 :]), flush=True)
    proc = subprocess.run(cmd, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"bench_elastic: the run above failed with exit code {proc.returncode}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        from lightning_dist import collectives

        (overhead_worker if args.worker == "overhead" else recovery_worker)(args)
        collectives.shutdown()
        return 0
    if not args.warmup + 2 <= args.steps or not 0 < args.kill_step < args.steps:
        raise SystemExit("bench_elastic: need --warmup + 2 <= --steps and 0 < --kill-step < --steps")
    print(
        f"machine: {machine()}\n2 workers x 1 thread, Gloo, embedded workload (WorkloadConfig())", flush=True
    )
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as tmp:
        overhead_dir, recovery_dir = Path(tmp, "overhead"), Path(tmp, "recovery")
        run(torchrun(args, "overhead", overhead_dir, max_restarts=0))
        run(torchrun(args, "recovery", recovery_dir, max_restarts=1))
        overhead = json.loads((overhead_dir / "overhead.json").read_text())
        recovery = json.loads((recovery_dir / "recovery.json").read_text())
        killed_at = float((recovery_dir / "killed_at").read_text())
    with_commits, without = statistics.median(overhead["commits"]), statistics.median(overhead["none"])
    ratio = with_commits / without
    paired = statistics.median(c / n for c, n in zip(overhead["commits"], overhead["none"]))
    recovery_s = recovery["first_step_at"] - killed_at
    redone = args.kill_step - recovery["resumed_from"]
    commit_ms = 1000 * statistics.median(overhead["commit_times"])
    rows = [
        ("mean step, no commits (median of rounds)", f"{1000 * without:.1f} ms", ""),
        (f"mean step, commit every {args.commit_every} (median of rounds)", f"{1000 * with_commits:.1f} ms", ""),
        ("commit overhead (commits / none; median of the rounds' own ratios)", f"{ratio:.3f} ({paired:.3f})", "<= 1.05"),
        ("one commit (median, rank 0)", f"{commit_ms:.1f} ms", ""),
        (f"recovery: kill after step {args.kill_step} -> first step after restart", f"{recovery_s:.1f} s", "< 15 s"),
        (f"steps redone (resumed from the commit of step {recovery['resumed_from']})", str(redone), f"<= {args.commit_every}"),
    ]  # fmt: skip
    print(markdown_table(rows, args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
