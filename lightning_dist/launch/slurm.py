"""sbatch scripts for a strategy: ``lightning-dist slurm`` (and ``--submit``).

One script per job: N nodes x G devices, a strategy name (which decides how the ranks start) and the
training command. A strategy class says how its ranks start in ``launch_needs``
(``lightning_dist/strategies/launch_needs.py``); the script follows from that. What each family gets:

- DDP family (``ld_ddp``, ``DDP``, ``compressed_*``, ``Compressed``, ``ld_diloco*``, ``DiLoCo``,
  ``ld_sharded*``, ``Sharded``, ``ShardedDiLoCo``, Lightning's ``ddp``):
  ``srun --ntasks-per-node=G``: one task per device, Lightning's ``SLURMEnvironment`` reads the ranks.
- Horovod (``horovod*``, ``Horovod``, ``horovod_adasum``, ``HorovodAdasum``): one MPI job of N x G
  ranks: ``srun --mpi=pmix`` when SLURM has the PMIx plugin, otherwise ``mpirun`` over the job's nodes.
- Elastic (``ld_elastic*``, ``Elastic``, ``ElasticDiLoCo``): one ``torchrun`` per node, c10d rendezvous on the first node,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's shared rendezvous store loses the round when a
  node leaves and joins again).
- FaultTolerant (``ld_fault_tolerant*``, ``FaultTolerant``): torchft's Lighthouse in the batch shell
  on the first node, and one replica group per node (``python -m lightning_dist.launch.fault_tolerant
  --group $SLURM_NODEID``: a warm standby and its torchrun of ``--devices`` processes,
  ``--nproc-per-group``; ``FaultTolerantDiLoCo``: 1); a group that dies is restarted by its torchrun
  while the others train on.
- ``HorovodElastic`` (``ld_horovod_elastic``) is refused: it needs horovodrun's elastic driver.

A class is launched as its registered names are: ``--strategy DiLoCo`` or
``lightning_dist:DiLoCo(inner_steps=8)`` as ``ld_diloco``.

Requeue (default): ``#SBATCH --requeue`` and a signal ``--signal-seconds`` before the time limit.
For the DDP and Horovod families SLURM sends SIGUSR1 to every task: Lightning's ``SLURMEnvironment``
(``auto_requeue=True``) saves ``<default_root_dir>/hpc_ckpt_<n>.ckpt`` and runs ``scontrol requeue``;
the requeued run's ``Trainer.fit`` resumes from the newest ``hpc_ckpt_*.ckpt`` by itself. For Elastic,
FaultTolerant (and Horovod under mpirun) the batch shell gets the signal (``B:``): those two resume
from their own commits, so the script just requeues; under mpirun it forwards the signal to mpirun, which passes it
to the ranks.

``--devices`` is one thing everywhere: the devices (GPUs, or CPU processes) of each node, one rank
per device. It is ``#SBATCH --ntasks-per-node`` (Elastic: one torchrun task per node with
``--nproc-per-node``), the Trainer's ``devices`` (Horovod: every rank has ``devices=1``) and, on GPUs,
``#SBATCH --gpus-per-node`` unless ``--gpus-per-node`` or a GPU ``--gres`` says otherwise.

The training command is not told twice (``--trainer-flags``): when it runs the package's trainer
(``examples/train.py``, ``python -m lightning_dist.workload.train``), whose flags are known, the
``--strategy``, ``--devices``, ``--accelerator`` and (DDP family) ``--num-nodes`` it leaves out are
appended from the job, and one it gives must agree with the job (a ``ValueError`` names both values).
The ``lightning-dist slurm`` command also works the other way: an option it is not given is taken
from the training command.

Here: the checked job (``SlurmJob``) and the command; the strategy spec in ``slurm_strategy``, the
option checks in ``slurm_checks``, the Trainer flags in ``slurm_command``, the script in
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

from lightning_dist.launch import slurm_checks as checks
from lightning_dist.launch.slurm_checks import GPU_CPUS_PER_TASK, parse_time
from lightning_dist.launch.slurm_cli import add_parser
from lightning_dist.launch.slurm_command import (
    command_flags,
    runs_workload_trainer,
    trainer_needs,
    unfilled_note,
    with_trainer_flags,
)
from lightning_dist.launch.slurm_options import SlurmOptions
from lightning_dist.launch.slurm_script import render, submit, write_script
from lightning_dist.launch.slurm_strategy import StrategyKind, accepted_strategies, resolve_strategy

__all__ = [
    "SlurmJob",
    "StrategyKind",
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
        checks.check_counts(self)
        self.kind = resolve_strategy(self.strategy)
        checks.check_texts(self)
        checks.check_gpus(self)
        checks.check_launch_needs(self)
        engine = self.kind.needs.engine
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

    def trainer_needs(self) -> str:
        """The Trainer arguments the job's ranks need, as Python (``strategy='ld_ddp', devices=4, ...``)."""
        return trainer_needs(self)

    def unfilled_note(self) -> Optional[str]:
        """What a command that did not get the job's flags must do itself (None when it got them)."""
        return unfilled_note(self)

    def render(self) -> str:
        """The script."""
        return render(self)


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
            mpi = resolve_strategy(strategy).needs.engine == "mpi"  # the command's devices is 1 per rank
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
