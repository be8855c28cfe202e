"""sbatch scripts for a strategy: ``lightning-dist slurm`` (and ``--submit``).

One script per job: N nodes x G devices of a strategy running a training command. The strategy
class's ``launch_needs`` (``lightning_dist/strategies/launch_needs.py``) decide how the ranks start:
srun with one task per device (Lightning's ``SLURMEnvironment``), one MPI job (``srun --mpi=pmix``,
else mpirun), one torchrun per node (c10d rendezvous on the first node) or torchft's Lighthouse and
one replica group per node; or the class is refused, saying why. With requeue (the default) SIGUSR1
comes ``--signal-seconds`` before the time limit: Lightning saves an hpc checkpoint and requeues, or,
for a strategy that resumes from its own commits, the batch shell requeues. When the training command
runs the package's trainer, its Trainer flags follow from the job (``--trainer-flags``).
docs/launch.md has the details.

Here: the checked job (``SlurmJob``) and the command; the strategy spec in ``slurm_strategy``, the
options and their checks in ``slurm_options``, the Trainer flags in ``slurm_command``, the script in
``slurm_script``, the argument parser in ``slurm_cli``.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Optional

from lightning_dist.launch import slurm_options as options
from lightning_dist.launch.slurm_cli import add_parser
from lightning_dist.launch.slurm_command import (
    command_flags,
    runs_workload_trainer,
    trainer_needs,
    unfilled_note,
    with_trainer_flags,
)
from lightning_dist.launch.slurm_options import GPU_CPUS_PER_TASK, SlurmOptions, parse_time
from lightning_dist.launch.slurm_script import render, submit, write_script
from lightning_dist.launch.slurm_strategy import accepted_strategies, resolve_strategy

__all__ = [
    "SlurmJob",
    "accepted_strategies",
    "add_parser",
    "job_from_args",
    "parse_time",
    "pmix_available",
    "resolve_strategy",
    "run",
    "submit",
    "write_script",
]
LAUNCHES = {"lightning": "srun", "torchrun": "torchrun", "torchft": "fault_tolerant"}
"""The launch of each engine but MPI's (``srun-pmix``, ``srun-pmi2`` or ``mpirun``: ``--mpi``)."""


def pmix_available() -> bool:
    """Whether this SLURM's srun lists the PMIx MPI plugin (``srun --mpi=list``)."""
    srun = shutil.which("srun")
    if srun is None:
        return False
    try:
        out = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "pmix" in (out.stdout + out.stderr)


@dataclass
class SlurmJob(SlurmOptions):
    """One sbatch script: ``nodes`` x ``devices`` ranks of ``strategy`` running ``command``.

    Every check runs in ``__post_init__``: a bad combination raises a ``ValueError`` with the reason
    before anything is written or submitted.
    """

    def __post_init__(self) -> None:
        options.check_counts(self)
        self.needs = resolve_strategy(self.strategy)
        options.check_texts(self)
        options.check_gpus(self)
        options.check_launch_needs(self)
        engine = self.needs.engine
        if engine in LAUNCHES:
            self.launch = LAUNCHES[engine]
        else:
            mpi = self.mpi or "auto"
            if mpi == "auto":
                mpi = "pmix" if pmix_available() else "mpirun"
            self.launch = "mpirun" if mpi == "mpirun" else f"srun-{mpi}"
        if self.cpus_per_task is None and self.accelerator == "gpu":
            self.cpus_per_task = GPU_CPUS_PER_TASK
        self.fills_trainer_flags = self.trainer_flags == "always" or (
            self.trainer_flags == "auto" and runs_workload_trainer(self.command)
        )
        if self.fills_trainer_flags:
            self.command = with_trainer_flags(self)

    trainer_needs = trainer_needs
    unfilled_note = unfilled_note
    render = render


def job_from_args(args: argparse.Namespace, command: list[str]) -> SlurmJob:
    """The job of a parsed ``lightning-dist slurm`` command line. ``--strategy``, ``--nodes``,
    ``--devices`` and ``--accelerator`` left unset are taken from the training command's flags where
    ``--trainer-flags`` applies (a ``ValueError`` then says what was taken)."""
    mode = args.trainer_flags
    given = (
        command_flags(command)
        if mode == "always" or (mode == "auto" and runs_workload_trainer(command))
        else {}
    )
    taken: list[str] = []

    def take(flag: str, ok: Callable[[str], bool]) -> Optional[str]:
        value = given.get(flag, "").strip()
        if not (value and ok(value)):
            return None
        taken.append(f"{flag} {value}")
        return value

    try:
        strategy = args.strategy or take("--strategy", bool) or "ld_ddp"
        nodes = args.nodes if args.nodes is not None else int(take("--num-nodes", str.isdigit) or 1)
        devices = args.devices
        if devices is None:
            mpi = resolve_strategy(strategy).engine == "mpi"  # the command's devices is 1 per rank
            devices = int((None if mpi else take("--devices", str.isdigit)) or 1)
        accelerator = args.accelerator
        if accelerator is None:
            said = take("--accelerator", lambda v: v.lower() in ("cpu", "gpu", "cuda"))
            accelerator = None if said is None else "cpu" if said.lower() == "cpu" else "gpu"
        computed = {
            "command": command,
            "nodes": nodes,
            "devices": devices,
            "strategy": strategy,
            "accelerator": accelerator,
            "gpus_per_node": args.gpus_per_node or 0,
            "setup": args.setup or (),
            "sbatch_args": args.sbatch_arg or (),
            "trainer_flags": mode,
        }
        # every other field is an option of the same name, passed as given
        as_given = {
            f.name: getattr(args, f.name) for f in fields(SlurmJob) if f.init and f.name not in computed
        }
        return SlurmJob(**computed, **as_given)
    except ValueError as exc:
        if not taken:
            raise
        raise ValueError(f"{exc} (taken from the training command: {', '.join(taken)})") from None


def run(args: argparse.Namespace, command: list[str]) -> int:
    """The ``slurm`` subcommand: build (checks first), write, maybe submit."""
    try:
        job = job_from_args(args, command)
    except ValueError as exc:
        print(f"lightning-dist slurm: {exc}", file=sys.stderr)
        return 2
    if args.script == "-":
        if args.submit:
            print("lightning-dist slurm: --submit needs a file: give --script PATH", file=sys.stderr)
            return 2
        sys.stdout.write(job.render())
        return 0
    path = write_script(job, args.script or f"{job.job_name}.sbatch")
    print(f"wrote {path} ({job.launch}, {job.nodes} x {job.devices} = {job.ranks} ranks)")
    if job.command != command:
        print(f"training command, flags filled in from the job: {shlex.join(job.command)}")
    note = job.unfilled_note()
    if note is not None:
        print(f"note: {note}")
    if not args.submit:
        print(f"submit with: sbatch {shlex.quote(str(path))}")
        return 0
    try:
        job_id = submit(path)
    except RuntimeError as exc:
        print(f"lightning-dist slurm: {exc}", file=sys.stderr)
        return 1
    print(f"submitted job {job_id}")
    return 0
