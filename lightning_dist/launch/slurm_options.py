"""The options of one sbatch script: their accepted values, the dataclass that holds them, and the checks
that ``SlurmJob`` runs on them (each value, then how they combine with the strategy's launch needs). A
bad one raises a ``ValueError`` naming the option and what is accepted, before anything is written."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_dist.strategies.launch_needs import LaunchNeeds

MPI_LAUNCHES = ("auto", "pmix", "pmi2", "mpirun")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_NAME = re.compile(r"^[A-Za-z0-9_.,:@%+=-]+$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_HOST = re.compile(r"^[A-Za-z0-9_.:-]+$")
_GRES = re.compile(r"^[A-Za-z0-9_/]+(:[A-Za-z0-9_.-]+)*(,[A-Za-z0-9_/]+(:[A-Za-z0-9_.-]+)*)*$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,:@%+=&|*!()\[\]-]+$")
_MAIL_USER = re.compile(r"^[A-Za-z0-9_.+%-]+(@[A-Za-z0-9.-]+)?$")
ACCELERATORS = ("cpu", "gpu")
EXCLUSIVE = ("user", "mcs", "topo")
"""``--exclusive=`` values (a bare ``--exclusive``: whole nodes)."""
MAIL_TYPES = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")  # fmt: skip
GPU_CPUS_PER_TASK = 8
"""``--cpus-per-task`` of a GPU task when none is given: cores for its dataloader workers (SLURM's own
default is 1, which a Lightning job's ``num_workers`` would share)."""
TRAINER_FLAG_MODES = ("auto", "always", "never")
SBATCH_OWNED = {
    "--job-name": "-J/--job-name",
    "--nodes": "-N/--nodes",
    "--ntasks": "-N/--nodes and --devices (tasks = nodes x devices)",
    "--ntasks-per-node": "--devices",
    "--cpus-per-task": "-c/--cpus-per-task",
    "--gpus": "--gpus-per-node or --gres",
    "--gpus-per-node": "--gpus-per-node",
    "--gpus-per-task": "--gpus-per-node (every task of a node must see all of its GPUs)",
    "--gres": "--gres",
    "--partition": "-p/--partition",
    "--time": "-t/--time",
    "--mem": "--mem",
    "--chdir": "-D/--chdir",
    "--output": "-o/--output",
    "--account": "-A/--account",
    "--qos": "-q/--qos",
    "--constraint": "-C/--constraint",
    "--exclusive": "--exclusive",
    "--mail-type": "--mail-type",
    "--mail-user": "--mail-user",
    "--signal": "--signal-seconds",
    "--requeue": "--requeue",
    "--no-requeue": "--no-requeue",
    "--open-mode": "--requeue (the output is appended to across requeues)",
}
"""sbatch options the script writes itself, and the option of ``lightning-dist slurm`` that sets each."""
SBATCH_SHORT = {"-J": "--job-name", "-N": "--nodes", "-n": "--ntasks", "-c": "--cpus-per-task", "-G": "--gpus",
                "-p": "--partition", "-t": "--time", "-D": "--chdir", "-o": "--output", "-A": "--account",
                "-q": "--qos", "-C": "--constraint"}  # fmt: skip
"""sbatch's short options and their long forms."""


def parse_time(value: str) -> int:
    """SLURM's ``--time`` (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``) in seconds."""
    match = _TIME.match(value.strip())
    if not match:
        raise ValueError(
            f"--time={value!r} is not a SLURM time; accepted: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"
        )
    days, a, b, c = match.groups()
    if days is not None:  # D-H[:M[:S]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # H:M:S
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 60


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gres_gpus(gres: Optional[str]) -> int:
    """GPUs per node that a ``--gres`` asks for (``gpu``: 1, ``gpu:4``, ``gpu:a100:4``; 0 without ``gpu``)."""
    total = 0
    for entry in (gres or "").split(","):
        name, *rest = entry.split(":")
        if name.removeprefix("gres/") == "gpu":
            total += int(rest[-1]) if rest and rest[-1].isdigit() else 1
    return total


def sbatch_arg(arg: str) -> str:
    """A ``--sbatch-arg`` as its ``#SBATCH`` line (``x=y`` gets a leading ``--``); a ``ValueError`` for
    one that is not an sbatch option or sets an option this script writes itself."""
    text = arg.strip()
    if text and not text.startswith("-"):
        text = "--" + text
    if any(c in text for c in "\n\r\0") or not re.match(r"^--?[A-Za-z]", text):
        raise ValueError(
            f"--sbatch-arg {arg!r} is not an sbatch option; accepted: one option per --sbatch-arg, "
            "as '--name=value', '--flag', '-X value' or 'name=value'"
        )
    if text.startswith("--"):
        name = re.split(r"[=\s]", text, maxsplit=1)[0]
        # sbatch takes any unambiguous prefix of an option (--nod=2 is --nodes=2)
        owned = next((o for o in SBATCH_OWNED if o == name or (len(name) > 3 and o.startswith(name))), None)
    else:
        owned = SBATCH_SHORT.get(text[:2])
    if owned is not None:
        raise ValueError(
            f"--sbatch-arg {arg!r} sets #SBATCH {owned}, which lightning-dist writes itself: "
            f"use {SBATCH_OWNED[owned]} instead"
        )
    return text


@dataclass
class SlurmOptions:
    """One sbatch script: ``nodes`` x ``devices`` ranks of ``strategy`` running ``command``."""

    command: list[str]
    """The training command (run once per rank, or once per node for Elastic's torchrun)."""
    nodes: int = 1
    """Nodes (``#SBATCH --nodes``); the Trainer's ``num_nodes``."""
    devices: int = 1
    """Devices per node (GPUs, or CPU processes), one rank each: ``--ntasks-per-node`` (Elastic:
    torchrun's ``--nproc-per-node``), on GPUs the default ``--gpus-per-node``; the Trainer's
    ``devices`` (1 for Horovod, whose every rank is one process)."""
    strategy: str = "ld_ddp"
    """Strategy spec (``resolve_strategy``): its ``launch_needs`` decide how the ranks start."""
    partition: Optional[str] = None
    time: Optional[str] = None
    """Time limit (SLURM's format); the requeue signal comes ``signal_seconds`` before it."""
    job_name: str = "lightning-dist"
    output: str = "%x-%j.out"
    """Output file (SLURM's patterns); appended to across requeues."""
    cpus_per_task: Optional[int] = None
    """CPUs per rank (Elastic's one task per node gets ``devices`` times this); None: ``GPU_CPUS_PER_TASK``
    on GPUs, SLURM's default (1) on CPUs."""
    gpus_per_node: int = 0
    """GPUs per node (0: none, or ``devices`` with ``accelerator="gpu"``); every task of a node sees all
    of them."""
    mem: Optional[str] = None
    """Memory per node (``64G``)."""
    signal_seconds: int = 90
    """Seconds before the time limit that SIGUSR1 comes (``#SBATCH --signal=SIGUSR1@<s>``)."""
    requeue: bool = True
    """``#SBATCH --requeue`` and the signal; False: ``--no-requeue`` and no signal."""
    port: Optional[int] = None
    """Elastic's rendezvous port (default 30000 + job id mod 10000); DDP's MASTER_PORT when given."""
    master_addr: Optional[str] = None
    """Address of the first node when its host name does not resolve (MASTER_ADDR / rendezvous)."""
    mpi: Optional[str] = None
    """Horovod only: ``auto`` (PMIx if srun lists it, else mpirun), ``pmix``, ``pmi2`` or ``mpirun``."""
    min_nodes: Optional[int] = None
    """Elastic only: keep training down to this many nodes (``torchrun --nnodes=MIN:N``)."""
    max_restarts: int = 3
    """Elastic only: ``torchrun --max-restarts``."""
    chdir: Optional[str] = None
    """Working directory of the job (Lightning's default_root_dir: hpc checkpoints, Elastic commits)."""
    accelerator: Optional[str] = None
    """``cpu`` or ``gpu`` (None: ``gpu`` when ``gpus_per_node`` or ``gres`` asks for GPUs, else ``cpu``)."""
    gres: Optional[str] = None
    """``#SBATCH --gres`` (``gpu:4``, ``gpu:a100:4,nvme:1``); a GPU count here replaces ``gpus_per_node``."""
    account: Optional[str] = None
    """``#SBATCH --account``: the account charged."""
    qos: Optional[str] = None
    """``#SBATCH --qos``."""
    constraint: Optional[str] = None
    """``#SBATCH --constraint``: node features (``a100&ib``, ``[rack1|rack2]``)."""
    exclusive: Union[bool, str] = False
    """``#SBATCH --exclusive`` (True: whole nodes; ``user``, ``mcs`` or ``topo``: SLURM's variants)."""
    mail_type: Optional[str] = None
    """``#SBATCH --mail-type``: comma-separated ``MAIL_TYPES`` (``END,FAIL``)."""
    mail_user: Optional[str] = None
    """``#SBATCH --mail-user`` (default: the submitting user); needs ``mail_type``."""
    setup: Sequence[str] = ()
    """Shell lines the batch script runs, in order, before the launch (``module load cuda``,
    ``source venv/bin/activate``); srun's tasks inherit the environment they make."""
    sbatch_args: Sequence[str] = ()
    """Other sbatch options, one per item, each written as ``#SBATCH <item>`` (``--exclude=n07``; a
    bare ``name=value`` gets ``--``); options this script writes itself are refused."""
    trainer_flags: str = "auto"
    """``auto``: fill in and check the training command's ``TRAINER_FLAGS`` when it runs the package's
    trainer; ``always``: for any command (it takes those flags as the package's trainer does);
    ``never``: leave the command as it is."""
    fills_trainer_flags: bool = field(init=False)
    """Whether ``command`` got the job's ``TRAINER_FLAGS`` (the package's trainer, or ``always``)."""
    needs: LaunchNeeds = field(init=False)
    """How the strategy's ranks start (``resolve_strategy``)."""
    launch: str = field(init=False)
    """``srun``, ``srun-pmix``, ``srun-pmi2``, ``mpirun``, ``torchrun`` or ``fault_tolerant``."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.devices

    @property
    def task_cpus(self) -> Optional[int]:
        """``--cpus-per-task`` of a SLURM task: a rank's, or (one agent per node) ``devices`` ranks'."""
        if self.needs.agent_per_node:
            return self.devices * (self.cpus_per_task or 1)
        return self.cpus_per_task

    @property
    def batch_signal(self) -> bool:
        """The batch shell takes the signal (a strategy that resumes from its commits: requeue; mpirun:
        forward it)."""
        return self.needs.resumes_from_commits or self.launch == "mpirun"


def _need_int(job: SlurmOptions, name: str, low: int, high: Optional[int] = None) -> None:
    value = getattr(job, name)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise ValueError(f"--{name.replace('_', '-')}={value!r} must be an integer >= {low}")
    if high is not None and value > high:
        raise ValueError(f"--{name.replace('_', '-')}={value!r} must be <= {high}")


def check_counts(job: SlurmOptions) -> None:
    """The training command is there; the counts are integers in range."""
    if not job.command:
        raise ValueError(
            "no training command: put it after `--`, e.g. "
            "`lightning-dist slurm --nodes 2 --devices 4 -- python train.py --devices 4 --num-nodes 2`"
        )
    _need_int(job, "nodes", 1)
    _need_int(job, "devices", 1)
    _need_int(job, "gpus_per_node", 0)
    _need_int(job, "max_restarts", 0)
    if job.cpus_per_task is not None:
        _need_int(job, "cpus_per_task", 1)
    if job.port is not None:
        _need_int(job, "port", 1, 65535)


def check_texts(job: SlurmOptions) -> None:
    """The time limit and its signal, the names and paths, the sbatch options of their own."""
    if job.requeue:
        _need_int(job, "signal_seconds", 1)
    if job.time is not None and job.time.upper() not in ("UNLIMITED", "INFINITE"):
        limit = parse_time(job.time)
        if limit < 1:
            raise ValueError(f"--time={job.time!r} must be at least one minute")
        if job.requeue and job.signal_seconds >= limit:
            raise ValueError(
                f"--signal-seconds={job.signal_seconds} is not below --time={job.time} ({limit} s): "
                "the requeue signal would come before training starts; lower it or raise --time"
            )
    for name, pattern in (
        ("partition", _NAME),
        ("job_name", _NAME),
        ("mem", _MEM),
        ("master_addr", _HOST),
        ("gres", _GRES),
        ("account", _NAME),
        ("qos", _NAME),
        ("constraint", _CONSTRAINT),
        ("mail_user", _MAIL_USER),
    ):
        value = getattr(job, name)
        if value is not None and not pattern.match(value):
            raise ValueError(
                f"--{name.replace('_', '-')}={value!r} is not accepted (allowed: {pattern.pattern})"
            )
    for name in ("output", "chdir"):
        value = getattr(job, name)
        if value is not None and (not value or any(c in value for c in "\n\r\"'")):
            raise ValueError(f"--{name}={value!r}: empty, or holds a quote or a line break")
    _check_sbatch_options(job)


def _check_sbatch_options(job: SlurmOptions) -> None:
    """``exclusive``, ``mail_type``/``mail_user``, ``setup`` and ``sbatch_args``."""
    if not (isinstance(job.exclusive, bool) or job.exclusive in EXCLUSIVE):
        raise ValueError(
            f"--exclusive={job.exclusive!r}; accepted: --exclusive (whole nodes) or "
            f"--exclusive={'|'.join(EXCLUSIVE)}"
        )
    if job.mail_type is not None:
        types = [t.strip().upper() for t in job.mail_type.split(",")]
        unknown = [t for t in types if t not in MAIL_TYPES]
        if unknown:
            raise ValueError(
                f"--mail-type={job.mail_type!r}: {', '.join(repr(t) for t in unknown)} not accepted; "
                f"accepted (comma-separated): {', '.join(MAIL_TYPES)}"
            )
        job.mail_type = ",".join(types)
    elif job.mail_user is not None:
        raise ValueError(
            f"--mail-user={job.mail_user} alone sends no mail: add --mail-type (e.g. END,FAIL or ALL)"
        )
    for line in job.setup:
        if not isinstance(line, str) or not line.strip() or any(c in line for c in "\n\r\0"):
            raise ValueError(
                f"--setup {line!r}: one non-empty shell line each (no line breaks); repeat --setup for more lines"
            )
    job.sbatch_args = [sbatch_arg(arg) for arg in job.sbatch_args]


def check_gpus(job: SlurmOptions) -> None:
    """Settle ``accelerator`` and ``gpus_per_node``: every rank of a node needs its own GPU."""
    from_gres = gres_gpus(job.gres)
    if from_gres and job.gpus_per_node:
        raise ValueError(
            f"--gres={job.gres} and --gpus-per-node={job.gpus_per_node} both ask for GPUs: give one of them"
        )
    gpus = job.gpus_per_node or from_gres
    if job.accelerator is None:
        job.accelerator = "gpu" if gpus else "cpu"
    if job.accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator={job.accelerator!r}; accepted: {', '.join(ACCELERATORS)}")
    if job.accelerator == "cpu" and gpus:
        asked = f"--gres={job.gres}" if from_gres else f"--gpus-per-node={job.gpus_per_node}"
        raise ValueError(
            f"--accelerator cpu but {asked} asks for GPUs: use --accelerator gpu, or drop {asked.split('=')[0]}"
        )
    if job.accelerator == "gpu" and not gpus:
        job.gpus_per_node = gpus = job.devices
    if job.accelerator == "gpu" and gpus < job.devices:
        asked = f"--gres={job.gres}" if job.gres and not job.gpus_per_node else f"--gpus-per-node={gpus}"
        raise ValueError(
            f"{asked} is fewer than --devices={job.devices}: each rank of a node needs its own "
            f"GPU; ask for {job.devices} GPUs per node (or fewer --devices)"
        )


def check_launch_needs(job: SlurmOptions) -> None:
    """The options against what the strategy needs (``job.needs``)."""
    needs, ranks = job.needs, job.ranks
    if needs.adasum:
        if job.accelerator == "gpu" and not power_of_two(job.nodes):
            raise ValueError(
                f"--strategy {job.strategy} on GPUs needs a power-of-two number of nodes (Horovod's "
                f"hierarchical Adasum), got --nodes={job.nodes}; use 1, 2, 4, 8... nodes, or "
                "DDP(reduce_op='adasum') (any world size)"
            )
        if job.accelerator != "gpu" and not power_of_two(ranks):
            raise ValueError(
                f"--strategy {job.strategy} needs a power-of-two number of ranks, got --nodes x --devices = "
                f"{job.nodes} x {job.devices} = {ranks}; use a power of two, or DDP(reduce_op='adasum') "
                "(strategy 'ld_ddp_adasum': any world size)"
            )
    if needs.engine != "mpi" and job.mpi is not None:
        raise ValueError(f"--mpi={job.mpi} applies to the Horovod strategies only, not {job.strategy}")
    if job.mpi is not None and job.mpi not in MPI_LAUNCHES:
        raise ValueError(f"--mpi={job.mpi!r}; accepted: {', '.join(MPI_LAUNCHES)}")
    if needs.engine != "torchrun" and job.min_nodes is not None:
        raise ValueError(
            f"--min-nodes applies to Elastic only (torchrun --nnodes=MIN:MAX), not {job.strategy}"
        )
    if job.min_nodes is not None:
        _need_int(job, "min_nodes", 1, job.nodes)
    if needs.one_process and job.devices != 1:
        raise ValueError(
            f"--devices={job.devices}: {job.strategy} runs one process per replica group and one "
            "group per node; accepted: --devices 1 (more groups: more --nodes)"
        )
    if job.trainer_flags not in TRAINER_FLAG_MODES:
        raise ValueError(f"--trainer-flags={job.trainer_flags!r}; accepted: {', '.join(TRAINER_FLAG_MODES)}")
