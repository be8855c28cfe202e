"""sbatch scripts for a strategy: ``lightning-dist slurm`` (and ``--submit``).

One script per job: N nodes x G devices, a strategy name (which decides how the ranks start) and the
training command. What each strategy family gets:

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

A class is launched as its registered names are (``_classify``): ``--strategy DiLoCo`` or
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
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

from typing_extensions import override

FAMILIES = ("ddp", "horovod", "elastic", "fault_tolerant")
MPI_LAUNCHES = ("auto", "pmix", "pmi2", "mpirun")
FORK_START_METHODS = ("spawn", "fork", "forkserver")
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
MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)
GPU_CPUS_PER_TASK = 8
"""``--cpus-per-task`` of a GPU task when none is given: cores for its dataloader workers (SLURM's own
default is 1, which a Lightning job's ``num_workers`` would share)."""
TRAINER_FLAG_MODES = ("auto", "always", "never")
TRAINER_FLAGS = ("--strategy", "--devices", "--accelerator", "--num-nodes")
"""The training command's flags that follow from the job (``--trainer-flags``)."""
WORKLOAD_SCRIPTS = ("examples/train.py", "examples/quickstart.py", "lightning_dist/workload/train.py")
WORKLOAD_MODULE = "lightning_dist.workload.train"
"""The package's trainer (``lightning_dist.workload.train.parse_args``): it takes ``TRAINER_FLAGS``."""
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
SBATCH_SHORT = {
    "-J": "--job-name",
    "-N": "--nodes",
    "-n": "--ntasks",
    "-c": "--cpus-per-task",
    "-G": "--gpus",
    "-p": "--partition",
    "-t": "--time",
    "-D": "--chdir",
    "-o": "--output",
    "-A": "--account",
    "-q": "--qos",
    "-C": "--constraint",
}


class _Raw(str):
    """A word of the script that the batch shell expands (``"$hosts"``): written unquoted."""


@dataclass(frozen=True)
class StrategyKind:
    """How a strategy's ranks start under SLURM."""

    name: str
    family: str
    """``ddp``, ``horovod``, ``elastic`` or ``fault_tolerant``."""
    adasum: bool = False
    """Horovod's Adasum: needs a power-of-two number of ranks (of nodes on GPUs)."""
    one_process: bool = False
    """One process per replica group (``FaultTolerantDiLoCo``): ``--devices 1`` only."""


HOROVOD_ELASTIC_REFUSED = (
    "HorovodElastic runs under horovodrun's elastic driver (horovodrun --min-np/--max-np "
    "--host-discovery-script, docs/horovod-elastic.md), which this script does not start: under srun, "
    "mpirun or torchrun every process would be Horovod's rank 0 of 1 and train alone; for elastic "
    "training under SLURM use ld_elastic (torchrun: restarts and world-size changes), or run horovodrun "
    "in an sbatch script of your own"
)


def _classify(cls: type, params: Mapping[str, Any]) -> Union[StrategyKind, str, None]:
    """How a strategy class starts its ranks under SLURM (``name`` left empty), the reason it is
    refused, or None for a strategy outside the pack and Lightning's DDP (DeepSpeed, XLA ...)."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dist.strategies import ElasticMixin, Horovod, HorovodAdasum, HorovodElastic, Sharded
    from lightning_dist.strategies.fault_tolerant import FaultTolerant
    from lightning_dist.strategies.fault_tolerant_diloco import FaultTolerantDiLoCo

    if issubclass(cls, HorovodElastic):
        return HOROVOD_ELASTIC_REFUSED
    if issubclass(cls, ElasticMixin):
        return StrategyKind("", "elastic")
    if issubclass(cls, FaultTolerant):
        return StrategyKind("", "fault_tolerant", one_process=issubclass(cls, FaultTolerantDiLoCo))
    if issubclass(cls, HorovodAdasum):
        return StrategyKind("", "horovod", adasum=True)
    if issubclass(cls, Horovod):
        return StrategyKind("", "horovod")
    if issubclass(cls, Sharded):
        return StrategyKind("", "ddp")  # one task per device, like DDP
    if cls is DDPStrategy or (issubclass(cls, DDPStrategy) and cls.__module__.startswith("lightning_dist.")):
        # Lightning's own ddp and lightning_dist's DDP/Compressed/DiLoCo (not DeepSpeed/XLA, DDP subclasses too)
        start = params.get("start_method", "popen")
        if start in FORK_START_METHODS:
            return (
                f"it starts its own processes (start_method={start!r}), but under SLURM srun starts "
                "one task per device; use 'ld_ddp' (or 'ddp' for Lightning's own)"
            )
        return StrategyKind("", "ddp")
    return None


def _registry() -> tuple[dict[str, StrategyKind], dict[str, str]]:
    """Accepted registered names, and refused ones with the reason."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401  (registers lightning_dist's strategy names)
    from lightning_dist.strategies.registry import resolve

    kinds: dict[str, StrategyKind] = {}
    refused: dict[str, str] = {}
    for name in StrategyRegistry.available_strategies():
        cls, params = resolve(StrategyRegistry, name)
        kind = _classify(cls, params) if isinstance(cls, type) else None
        if isinstance(kind, str):
            refused[name] = kind
        elif kind is not None:
            kinds[name] = replace(kind, name=name)
    return kinds, refused


def class_kinds() -> dict[str, Union[StrategyKind, str]]:
    """lightning_dist's strategy classes (``--strategy DDP`` or ``lightning_dist:DDP(...)``): how each
    starts its ranks, or why it is refused."""
    import lightning_dist.strategies as strategies

    out: dict[str, Union[StrategyKind, str]] = {}
    for name in strategies.STRATEGIES:
        kind = _classify(getattr(strategies, name), {})
        if kind is not None:
            out[name] = kind
    return out


def accepted_strategies() -> list[str]:
    """The names ``--strategy`` accepts (registered names and lightning_dist's class names)."""
    kinds, _ = _registry()
    return _ordered(kinds)


def _ordered(kinds: dict[str, StrategyKind]) -> list[str]:
    """Registered names by family (DDP, Horovod, Elastic), then the class names."""
    order = {family: i for i, family in enumerate(FAMILIES)}
    names = sorted(kinds, key=lambda n: (order[kinds[n].family], not n.startswith(("ld_", "compressed_")), n))
    classes = {c: k for c, k in class_kinds().items() if isinstance(k, StrategyKind)}
    return names + sorted(classes, key=lambda c: (order[classes[c].family], c))


def resolve_strategy(spec: str) -> StrategyKind:
    """The family of a registered name, a class name (``DDP``) or ``lightning_dist:Class(kw=...)``."""
    kinds, refused = _registry()
    if spec in kinds:
        return kinds[spec]
    if spec in refused:
        raise ValueError(f"--strategy {spec!r} is refused under SLURM: {refused[spec]}")
    class_name, kwargs = spec, {}
    if ":" in spec:
        module, _, expr = spec.partition(":")
        try:
            call = ast.parse(expr if "(" in expr else expr + "()", mode="eval").body
            assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
            class_name = call.func.id
        except (SyntaxError, ValueError, AssertionError):
            class_name = ""
        if module.split(".")[0] != "lightning_dist":
            class_name = ""
    kind = class_kinds().get(class_name)
    if isinstance(kind, str):
        raise ValueError(f"--strategy {spec!r} is refused under SLURM: {kind}")
    if kind is not None:
        if kwargs.get("start_method") in FORK_START_METHODS:
            raise ValueError(
                f"--strategy {spec!r}: start_method={kwargs['start_method']!r} starts its own processes, "
                "but under SLURM srun starts one task per device; leave start_method at 'auto' or 'popen'"
            )
        if class_name == "Horovod" and kwargs.get("op") == "adasum":
            raise ValueError(
                f"--strategy {spec!r}: Horovod(op='adasum') is not a strategy; use "
                "'lightning_dist:HorovodAdasum()' (or the name ld_horovod_adasum) for Horovod's Adasum"
            )
        return replace(kind, name=spec)
    accepted = ", ".join(_ordered(kinds))
    raise ValueError(
        f"--strategy {spec!r} is not a strategy lightning-dist can launch; accepted: {accepted} "
        "(or 'lightning_dist:Class(keyword=literal, ...)')"
    )


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


def _is_python(arg: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)*)?", os.path.basename(arg)) is not None


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def gres_gpus(gres: Optional[str]) -> int:
    """GPUs per node that a ``--gres`` asks for (``gpu``: 1, ``gpu:4``, ``gpu:a100:4``; 0 without ``gpu``)."""
    total = 0
    for entry in (gres or "").split(","):
        name, *rest = entry.split(":")
        if name.removeprefix("gres/") == "gpu":
            total += int(rest[-1]) if rest and rest[-1].isdigit() else 1
    return total


def runs_workload_trainer(command: Sequence[str]) -> bool:
    """Whether ``command`` runs the package's trainer (``python [opts] examples/train.py ...`` or
    ``python -m lightning_dist.workload.train ...``), whose ``TRAINER_FLAGS`` are known."""
    if not command or not _is_python(command[0]):
        return False
    i = 1
    while i < len(command) and command[i].startswith("-"):
        if command[i] == "-m":
            return command[i + 1 : i + 2] == [WORKLOAD_MODULE]
        if command[i] == "-c":
            return False
        i += 2 if command[i] in ("-X", "-W") else 1
    if i >= len(command):
        return False
    script = os.path.normpath(command[i]).replace(os.sep, "/")
    return any(script == s or script.endswith("/" + s) for s in WORKLOAD_SCRIPTS)


def command_flags(command: Sequence[str]) -> dict[str, str]:
    """The values ``command`` gives for ``TRAINER_FLAGS`` (``--flag V`` or ``--flag=V``; the last one
    wins, as with argparse; nothing after a ``--`` word)."""
    found: dict[str, str] = {}
    i = 0
    while i < len(command) and command[i] != "--":
        name, eq, value = command[i].partition("=")
        if name in TRAINER_FLAGS:
            if not eq:
                if i + 1 >= len(command):
                    raise ValueError(f"the training command ends with {name} and no value: give {name} VALUE")
                i += 1
                value = command[i]
            found[name] = value
        i += 1
    return found


def _trainer_strategy(spec: str) -> str:
    """``--strategy`` as the package's trainer takes it: a class name is ``lightning_dist:Class``."""
    return f"lightning_dist:{spec}" if spec in class_kinds() else spec


def _same_strategy(a: str, b: str) -> bool:
    def canonical(spec: str) -> str:
        spec = _trainer_strategy(spec.replace(" ", ""))
        return spec + "()" if ":" in spec and not spec.endswith(")") else spec

    return canonical(a) == canonical(b)


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
class SlurmJob:
    """One sbatch script: ``nodes`` x ``devices`` ranks of ``strategy`` running ``command``.

    Every check runs in ``__post_init__``: a bad combination raises a ``ValueError`` with the reason
    before anything is written or submitted.
    """

    command: list[str]
    """The training command (run once per rank, or once per node for Elastic's torchrun)."""
    nodes: int = 1
    """Nodes (``#SBATCH --nodes``); the Trainer's ``num_nodes``."""
    devices: int = 1
    """Devices per node (GPUs, or CPU processes), one rank each: ``--ntasks-per-node`` (Elastic:
    torchrun's ``--nproc-per-node``), on GPUs the default ``--gpus-per-node``; the Trainer's
    ``devices`` (1 for Horovod, whose every rank is one process)."""
    strategy: str = "ld_ddp"
    """Strategy name: decides how the ranks start (see the module docstring)."""
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
    kind: StrategyKind = field(init=False)
    launch: str = field(init=False)
    """``srun``, ``srun-pmix``, ``srun-pmi2``, ``mpirun`` or ``torchrun``."""

    def __post_init__(self) -> None:
        def need_int(name: str, low: int, high: Optional[int] = None) -> None:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be an integer >= {low}")
            if high is not None and value > high:
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be <= {high}")

        if not self.command:
            raise ValueError(
                "no training command: put it after `--`, e.g. "
                "`lightning-dist slurm --nodes 2 --devices 4 -- python train.py --devices 4 --num-nodes 2`"
            )
        need_int("nodes", 1)
        need_int("devices", 1)
        need_int("gpus_per_node", 0)
        need_int("max_restarts", 0)
        if self.cpus_per_task is not None:
            need_int("cpus_per_task", 1)
        if self.port is not None:
            need_int("port", 1, 65535)
        self.kind = resolve_strategy(self.strategy)
        family, ranks = self.kind.family, self.nodes * self.devices
        if self.requeue:
            need_int("signal_seconds", 1)
        if self.time is not None and self.time.upper() not in ("UNLIMITED", "INFINITE"):
            limit = parse_time(self.time)
            if limit < 1:
                raise ValueError(f"--time={self.time!r} must be at least one minute")
            if self.requeue and self.signal_seconds >= limit:
                raise ValueError(
                    f"--signal-seconds={self.signal_seconds} is not below --time={self.time} ({limit} s): "
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
            value = getattr(self, name)
            if value is not None and not pattern.match(value):
                raise ValueError(
                    f"--{name.replace('_', '-')}={value!r} is not accepted (allowed: {pattern.pattern})"
                )
        for name in ("output", "chdir"):
            value = getattr(self, name)
            if value is not None and (not value or any(c in value for c in "\n\r\"'")):
                raise ValueError(f"--{name}={value!r}: empty, or holds a quote or a line break")
        self._check_sbatch_options()
        gpus = self._resolve_gpus()
        if self.accelerator == "gpu" and gpus < self.devices:
            asked = (
                f"--gres={self.gres}" if self.gres and not self.gpus_per_node else f"--gpus-per-node={gpus}"
            )
            raise ValueError(
                f"{asked} is fewer than --devices={self.devices}: each rank of a node needs its own "
                f"GPU; ask for {self.devices} GPUs per node (or fewer --devices)"
            )
        if self.kind.adasum:
            if self.accelerator == "gpu" and not _power_of_two(self.nodes):
                raise ValueError(
                    f"--strategy {self.strategy} on GPUs needs a power-of-two number of nodes (Horovod's "
                    f"hierarchical Adasum), got --nodes={self.nodes}; use 1, 2, 4, 8... nodes, or "
                    "DDP(reduce_op='adasum') (any world size)"
                )
            if self.accelerator != "gpu" and not _power_of_two(ranks):
                raise ValueError(
                    f"--strategy {self.strategy} needs a power-of-two number of ranks, got --nodes x --devices = "
                    f"{self.nodes} x {self.devices} = {ranks}; use a power of two, or DDP(reduce_op='adasum') "
                    "(strategy 'ld_ddp_adasum': any world size)"
                )
        if family != "horovod" and self.mpi is not None:
            raise ValueError(f"--mpi={self.mpi} applies to the Horovod strategies only, not {self.strategy}")
        if self.mpi is not None and self.mpi not in MPI_LAUNCHES:
            raise ValueError(f"--mpi={self.mpi!r}; accepted: {', '.join(MPI_LAUNCHES)}")
        if family != "elastic" and self.min_nodes is not None:
            raise ValueError(
                f"--min-nodes applies to Elastic only (torchrun --nnodes=MIN:MAX), not {self.strategy}"
            )
        if self.min_nodes is not None:
            need_int("min_nodes", 1, self.nodes)
        if family == "fault_tolerant" and self.kind.one_process and self.devices != 1:
            raise ValueError(
                f"--devices={self.devices}: {self.strategy} runs one process per replica group and one "
                "group per node; accepted: --devices 1 (more groups: more --nodes)"
            )
        if family == "ddp":
            self.launch = "srun"
        elif family == "elastic":
            self.launch = "torchrun"
        elif family == "fault_tolerant":
            self.launch = "fault_tolerant"
        else:
            mpi = self.mpi or "auto"
            if mpi == "auto":
                mpi = "pmix" if pmix_available() else "mpirun"
            self.launch = "mpirun" if mpi == "mpirun" else f"srun-{mpi}"
        if self.trainer_flags not in TRAINER_FLAG_MODES:
            raise ValueError(
                f"--trainer-flags={self.trainer_flags!r}; accepted: {', '.join(TRAINER_FLAG_MODES)}"
            )
        if self.cpus_per_task is None and self.accelerator == "gpu":
            self.cpus_per_task = GPU_CPUS_PER_TASK
        self.fills_trainer_flags = self.trainer_flags == "always" or (
            self.trainer_flags == "auto" and runs_workload_trainer(self.command)
        )
        if self.fills_trainer_flags:
            self.command = self._with_trainer_flags()

    def _check_sbatch_options(self) -> None:
        """``exclusive``, ``mail_type``/``mail_user``, ``setup`` and ``sbatch_args``."""
        if not (isinstance(self.exclusive, bool) or self.exclusive in EXCLUSIVE):
            raise ValueError(
                f"--exclusive={self.exclusive!r}; accepted: --exclusive (whole nodes) or "
                f"--exclusive={'|'.join(EXCLUSIVE)}"
            )
        if self.mail_type is not None:
            types = [t.strip().upper() for t in self.mail_type.split(",")]
            unknown = [t for t in types if t not in MAIL_TYPES]
            if unknown:
                raise ValueError(
                    f"--mail-type={self.mail_type!r}: {', '.join(repr(t) for t in unknown)} not accepted; "
                    f"accepted (comma-separated): {', '.join(MAIL_TYPES)}"
                )
            self.mail_type = ",".join(types)
        elif self.mail_user is not None:
            raise ValueError(
                f"--mail-user={self.mail_user} alone sends no mail: add --mail-type (e.g. END,FAIL or ALL)"
            )
        for line in self.setup:
            if not isinstance(line, str) or not line.strip() or any(c in line for c in "\n\r\0"):
                raise ValueError(
                    f"--setup {line!r}: one non-empty shell line each (no line breaks); repeat --setup "
                    "for more lines"
                )
        self.sbatch_args = [sbatch_arg(arg) for arg in self.sbatch_args]

    def _resolve_gpus(self) -> int:
        """Settle ``accelerator`` and ``gpus_per_node``; the GPUs per node the job asks for."""
        from_gres = gres_gpus(self.gres)
        if from_gres and self.gpus_per_node:
            raise ValueError(
                f"--gres={self.gres} and --gpus-per-node={self.gpus_per_node} both ask for GPUs: give one of them"
            )
        gpus = self.gpus_per_node or from_gres
        if self.accelerator is None:
            self.accelerator = "gpu" if gpus else "cpu"
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"--accelerator={self.accelerator!r}; accepted: {', '.join(ACCELERATORS)}")
        if self.accelerator == "cpu" and gpus:
            asked = f"--gres={self.gres}" if from_gres else f"--gpus-per-node={self.gpus_per_node}"
            raise ValueError(
                f"--accelerator cpu but {asked} asks for GPUs: use --accelerator gpu, or drop {asked.split('=')[0]}"
            )
        if self.accelerator == "gpu" and not gpus:
            self.gpus_per_node = gpus = self.devices
        return gpus

    def _wanted_flags(self) -> dict[str, str]:
        """The ``TRAINER_FLAGS`` values that follow from the job."""
        one_per_rank = self.kind.family in ("horovod", "fault_tolerant")
        return {
            "--strategy": _trainer_strategy(self.strategy),
            "--devices": "1" if one_per_rank else str(self.devices),
            "--accelerator": str(self.accelerator),
            "--num-nodes": str(self.nodes),
        }

    def _added_flag(self, flag: str) -> bool:
        """Whether ``flag`` is appended when the command leaves it out: Horovod and Elastic take the
        node count from MPI / the rendezvous (checked, not added)."""
        return flag != "--num-nodes" or self.kind.family == "ddp"

    def trainer_needs(self) -> str:
        """The Trainer arguments the job's ranks need, as Python (``strategy='ld_ddp', devices=4, ...``)."""
        spec = _trainer_strategy(self.strategy)
        if spec.startswith("lightning_dist:"):
            expr = spec.partition(":")[2]
            strategy = expr if expr.endswith(")") else expr + "()"
        else:
            strategy = repr(spec)
        wanted = self._wanted_flags()
        parts = [f"strategy={strategy}", f"devices={wanted['--devices']}"]
        if self._added_flag("--num-nodes"):
            parts.append(f"num_nodes={wanted['--num-nodes']}")
        parts.append(f"accelerator={wanted['--accelerator']!r}")
        return ", ".join(parts)

    def unfilled_note(self) -> Optional[str]:
        """What a command that did not get the job's flags must do itself (None when it got them)."""
        if self.fills_trainer_flags:
            return None
        why = (
            "is not the package's trainer, so it is left as it is (--trainer-flags auto)"
            if self.trainer_flags == "auto"
            else "is left as it is (--trainer-flags never)"
        )
        return (
            f"the training command {why}: its Trainer needs {self.trainer_needs()} (given in the script, "
            "or as flags it reads; --trainer-flags always appends --strategy/--devices/--accelerator/--num-nodes "
            "to a command that takes them as examples/train.py does)"
        )

    def _with_trainer_flags(self) -> list[str]:
        """The command with the ``TRAINER_FLAGS`` it leaves out appended; one it gives must agree."""
        given = command_flags(self.command)
        horovod = self.kind.family == "horovod"
        wanted = self._wanted_flags()
        devices = wanted["--devices"]
        fill = [f for f in TRAINER_FLAGS if f not in given and self._added_flag(f)]
        fix = "drop it from the training command (it is filled in from the job) or give the same value"
        for flag, value in given.items():
            if flag == "--strategy" and not _same_strategy(value, self.strategy):
                raise ValueError(
                    f"the training command has --strategy {value} but the job's --strategy is {self.strategy}: "
                    "give it once (lightning-dist slurm takes the command's when it has none) or the same on "
                    "both; for a strategy of your own, give --strategy the family that starts its ranks "
                    "(e.g. ld_ddp) and --trainer-flags never"
                )
            if flag == "--devices" and value.strip() != devices:
                if horovod:
                    raise ValueError(
                        f"the training command has --devices {value} but {self.strategy} (Horovod) runs one "
                        f"process per device: --devices={self.devices} ranks per node, each with the Trainer's "
                        "devices=1; drop --devices from the training command (it is filled in) or give 1"
                    )
                raise ValueError(
                    f"the training command has --devices {value} but --devices={self.devices}: the Trainer's "
                    f"devices are the ranks (SLURM tasks) per node; {fix}"
                )
            if flag == "--num-nodes" and value.strip() != wanted[flag]:
                raise ValueError(
                    f"the training command has --num-nodes {value} but --nodes={self.nodes}; {fix}"
                )
            if flag == "--accelerator":
                said = {"gpu": "gpu", "cuda": "gpu", "cpu": "cpu", "auto": self.accelerator}.get(
                    value.lower()
                )
                if said != self.accelerator:
                    why = (
                        f"--gres={self.gres}"
                        if self.gres and gres_gpus(self.gres)
                        else f"--gpus-per-node={self.gpus_per_node}"
                        if self.gpus_per_node
                        else "no GPUs asked for"
                    )
                    raise ValueError(
                        f"the training command has --accelerator {value} but the job's --accelerator is "
                        f"{self.accelerator} ({why}); the command may say cpu, gpu, cuda or auto: {fix}"
                    )
        return [*self.command, *(word for f in fill for word in (f, wanted[f]))]

    # -- the script --------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return self.nodes * self.devices

    @property
    def task_cpus(self) -> Optional[int]:
        """``--cpus-per-task`` of a SLURM task: a rank's, or (one agent per node) ``devices`` ranks'."""
        if self.launch in ("torchrun", "fault_tolerant"):
            return self.devices * (self.cpus_per_task or 1)
        return self.cpus_per_task

    def _batch_signal(self) -> bool:
        """The batch shell takes the signal (Elastic, FaultTolerant: requeue; mpirun: forward it)."""
        return self.launch in ("torchrun", "fault_tolerant", "mpirun")

    def header(self) -> list[str]:
        elastic = self.launch in ("torchrun", "fault_tolerant")  # one task (an agent) per node
        lines = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={1 if elastic else self.devices}",
        ]
        if self.task_cpus is not None:
            lines.append(f"--cpus-per-task={self.task_cpus}")
        if self.gpus_per_node:
            lines.append(f"--gpus-per-node={self.gpus_per_node}")
        for name in ("gres", "partition", "account", "qos", "constraint", "time", "mem", "chdir"):
            value = getattr(self, name)
            if value is not None:
                lines.append(f"--{name}={value}")
        if self.exclusive:
            lines.append("--exclusive" if self.exclusive is True else f"--exclusive={self.exclusive}")
        lines.append(f"--output={self.output}")
        for name in ("mail_type", "mail_user"):
            value = getattr(self, name)
            if value is not None:
                lines.append(f"--{name.replace('_', '-')}={value}")
        if self.requeue:
            prefix = "B:" if self._batch_signal() else ""
            lines += ["--open-mode=append", f"--signal={prefix}SIGUSR1@{self.signal_seconds}", "--requeue"]
        else:
            lines.append("--no-requeue")
        return [f"#SBATCH {line}" for line in [*lines, *self.sbatch_args]]

    def launch_command(self) -> list[str]:
        """The line that starts the ranks (shell words; ``$...`` expanded by the batch shell)."""
        g = str(self.devices)
        if self.launch == "srun":
            return ["srun", f"--ntasks-per-node={g}", "--kill-on-bad-exit=1", *self.command]
        if self.launch.startswith("srun-"):
            mpi = self.launch.split("-", 1)[1]
            return ["srun", f"--mpi={mpi}", f"--ntasks-per-node={g}", "--kill-on-bad-exit=1", *self.command]
        if self.launch == "mpirun":
            return [
                "mpirun",
                "-np",
                str(self.ranks),
                "--host",
                _Raw('"$hosts"'),
                "--map-by",
                f"ppr:{g}:node",
                "--bind-to",
                "none",
                _Raw("$as_root"),
                *self.command,
            ]
        if self.launch == "fault_tolerant":
            return self._fault_tolerant_command()
        nnodes = f"{self.min_nodes}:{self.nodes}" if self.min_nodes is not None else str(self.nodes)
        options = [
            f"--nnodes={nnodes}",
            f"--nproc-per-node={g}",
            f"--max-restarts={self.max_restarts}",
            "--rdzv-backend=c10d",
            _Raw('--rdzv-endpoint="$head:$port"'),
            _Raw('--rdzv-id="$SLURM_JOB_ID"'),
        ]
        cmd = self.command
        if _is_python(cmd[0]) and len(cmd) > 1 and (cmd[1] == "-m" or not cmd[1].startswith("-")):
            runner = [cmd[0], "-m", "torch.distributed.run", *options, *cmd[1:]]
        else:
            runner = ["torchrun", *options, "--no-python", *cmd]
        return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", *runner]

    def _lighthouse_lines(self) -> list[str]:
        """FaultTolerant: torchft's Lighthouse in the batch shell (it runs on the first node), bound
        to the first node's address only, ended when the script exits."""
        addr = self.master_addr or "$(getent ahostsv4 \"$head\" | awk '{print $1; exit}')"
        port = str(self.port) if self.port is not None else "$((30000 + SLURM_JOB_ID % 10000))"
        return [
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"lighthouse_addr={addr}",
            f"port={port}",
            "# torchft's Lighthouse (quorum of the replica groups), on the first node's address only; it and the",
            "# groups' servers are not authenticated: run on a trusted network (docs/live-recovery.md).",
            "# torchft's logs (the Lighthouse's, the groups' servers') are warnings only unless LD_FT_VERBOSE=1",
            "# (or your own RUST_LOG) is set.",
            'export RUST_LOG="${RUST_LOG:-$([ "${LD_FT_VERBOSE:-0}" = 1 ] && echo info || echo warn)}"',
            'torchft_lighthouse --bind "$lighthouse_addr:$port" --min_replicas 1 --join_timeout_ms 1000 '
            "--heartbeat_timeout_ms 5000 &",
            "lighthouse=$!",
            "trap 'kill \"$lighthouse\" 2>/dev/null || true' EXIT",
            "# FaultTolerant's commits (default <default_root_dir>/ft_commits) must be on a filesystem every",
            "# node sees; a requeued run resumes from the newest one by itself.",
        ]

    def _fault_tolerant_command(self) -> list[str]:
        """One replica group of ``devices`` processes per node: its id is the node's
        (``$SLURM_NODEID``, expanded in the task), its address the one that reaches the Lighthouse
        (``--host auto``)."""
        cmd, python = self.command, "python"
        if _is_python(cmd[0]):
            python, cmd = cmd[0], cmd[1:]
        if not cmd or (cmd[0].startswith("-") and cmd[0] != "-m"):
            raise ValueError(
                f"the training command {shlex.join(self.command)!r}: {self.strategy} runs a Python script "
                "in each replica group's standby; accepted: python script.py [args] or python -m module [args]"
            )
        per_group = f"--nproc-per-group {self.devices} " if self.devices != 1 else ""
        group = (
            f'exec {shlex.quote(python)} -m lightning_dist.launch.fault_tolerant --group "$SLURM_NODEID" '
            f'--lighthouse "$0" --host auto {per_group}--max-restarts {self.max_restarts} -- "$@"'
        )
        return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "bash", "-c", group,
                _Raw('"http://$lighthouse_addr:$port"'), *cmd]  # fmt: skip

    def render(self) -> str:
        from lightning_dist import __version__

        def words(cmd: Sequence[str]) -> str:
            return " ".join(w if isinstance(w, _Raw) else shlex.quote(w) for w in cmd)

        family = self.kind.family
        how = {
            "srun": f"srun starts {self.devices} task(s) per node, one per device; Lightning's SLURMEnvironment reads the ranks",
            "srun-pmix": "srun --mpi=pmix starts one MPI job of all ranks (Horovod)",
            "srun-pmi2": "srun --mpi=pmi2 starts one MPI job of all ranks (Horovod)",
            "mpirun": "mpirun starts one MPI job of all ranks over the job's nodes (Horovod; no PMIx in srun)",
            "torchrun": "one torchrun per node; c10d rendezvous on the first node (Elastic)",
            "fault_tolerant": f"torchft's Lighthouse on the first node, one replica group of {self.devices} "
            "process(es) per node (FaultTolerant)",
        }[self.launch]
        lines = [
            "#!/bin/bash",
            f"# Written by `lightning-dist slurm` (lightning_dist {__version__}): strategy {self.strategy} "
            f"({family} family), {self.nodes} node(s) x {self.devices} device(s) = {self.ranks} rank(s).",
            f"# {how}.",
            "# Submit: sbatch <this file>",
            *(
                f"# Note: {line}" if i == 0 else f"# {line}"
                for i, line in enumerate(_wrap(self.unfilled_note()))
            ),
            *self.header(),
            "set -euo pipefail",
            'echo "lightning-dist: job ${SLURM_JOB_ID} run ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}"',
        ]
        if self.setup:
            # environment scripts (module, conda, venv's activate) may read unset variables: no `set -u`
            lines += [
                "# --setup: run here before the launch; the ranks inherit the environment",
                "set +u",
                *self.setup,
                "set -u",
            ]
        if self.requeue and family not in ("elastic", "fault_tolerant"):
            who = (
                "the batch shell gets SIGUSR1 and forwards it to mpirun, which passes it to every rank"
                if self.launch == "mpirun"
                else "every rank gets SIGUSR1"
            )
            lines += [
                f"# {self.signal_seconds} s before the time limit {who}: Lightning's SLURMEnvironment",
                "# (auto_requeue=True) saves <default_root_dir>/hpc_ckpt_<n>.ckpt and runs `scontrol requeue`;",
                "# the requeued run's Trainer.fit() resumes from the newest hpc_ckpt_*.ckpt by itself, so keep",
                "# default_root_dir (default: the working directory) the same across runs.",
            ]
        if self.master_addr is not None and family not in ("elastic", "fault_tolerant"):
            lines.append(f"export MASTER_ADDR={self.master_addr}")
        if self.port is not None and family == "ddp":
            lines.append(f"export MASTER_PORT={self.port}")
        if self.launch == "mpirun":
            lines += [
                f'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\\$/:{self.devices}/" | paste -sd, -)',
                'as_root=$([ "$(id -u)" = 0 ] && echo --allow-run-as-root || true)',
            ]
        if self.launch == "torchrun":
            head = self.master_addr or '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
            port = str(self.port) if self.port is not None else "$((30000 + SLURM_JOB_ID % 10000))"
            lines += [
                "# torch's shared rendezvous store breaks when a node leaves and joins again: one store per agent",
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                f"head={head}",
                f"port={port}",
                "# Elastic's commits (default <default_root_dir>/elastic_commits) must be on a filesystem every",
                "# node sees; a requeued run resumes from the newest one by itself.",
            ]
        if self.launch == "fault_tolerant":
            lines += self._lighthouse_lines()
        if self.task_cpus is not None and self.launch != "mpirun":
            lines += [
                "# srun (SLURM >= 22.05) does not inherit sbatch's --cpus-per-task: give it to each task",
                f"export SRUN_CPUS_PER_TASK={self.task_cpus}",
            ]
        launch = words(self.launch_command())
        if not (self.requeue and self._batch_signal()):
            lines.append(launch)
            return "\n".join(lines) + "\n"
        if self.launch in ("torchrun", "fault_tolerant"):
            lines += [
                "on_signal() {",
                f'  echo "lightning-dist: SIGUSR1 (time limit near): requeueing job $SLURM_JOB_ID; {self.kind.name} resumes from its last commit"',
                '  scontrol requeue "$SLURM_JOB_ID"',
                "}",
            ]
        else:
            lines += [
                "on_signal() {",
                '  echo "lightning-dist: SIGUSR1 (time limit near): forwarded to mpirun, Lightning saves and requeues"',
                '  kill -USR1 "$launcher" 2>/dev/null || true',
                "}",
            ]
        lines += [
            "trap on_signal USR1",
            f"{launch} &",
            "launcher=$!",
            "# wait returns early when the trap runs: wait again until the launcher has exited",
            "while true; do",
            '  rc=0; wait "$launcher" || rc=$?',
            '  if [ "$rc" -gt 128 ] && kill -0 "$launcher" 2>/dev/null; then continue; fi',
            "  break",
            "done",
            'exit "$rc"',
        ]
        return "\n".join(lines) + "\n"


def _wrap(text: Optional[str], width: int = 98) -> list[str]:
    """``text`` as comment lines of at most ``width`` characters (none for None)."""
    import textwrap

    return textwrap.wrap(text, width) if text else []


def write_script(job: SlurmJob, path: str | os.PathLike[str]) -> Path:
    """Write ``job``'s script (executable) to ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(job.render())
    out.chmod(0o755)
    return out


def submit(path: str | os.PathLike[str]) -> str:
    """``sbatch --parsable path``: the job id (a ``RuntimeError`` with sbatch's message otherwise)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError(
            "sbatch not found: install SLURM's client (slurm-client) or submit the script elsewhere"
        )
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(
            f"sbatch {path} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout.strip().split(";")[0]


# -- the `lightning-dist slurm` command -------------------------------------------------------------
DESCRIPTION = """\
Write (and with --submit, submit) an sbatch script that runs TRAINING_COMMAND (everything after
`--`) with --nodes x --devices ranks of --strategy. --devices is the devices (GPUs, or CPU
processes) of each node, one rank per device: #SBATCH --ntasks-per-node and, with --accelerator gpu,
--gpus-per-node. How the ranks start depends on the strategy: DDP/Compressed: `srun
--ntasks-per-node=DEVICES` (the Trainer has devices=DEVICES, num_nodes=NODES); Horovod/HorovodAdasum:
one MPI job (`srun --mpi=pmix`, else mpirun; the Trainer has devices=1); Elastic: one torchrun per
node with a c10d rendezvous on the first node; FaultTolerant: torchft's Lighthouse on the first node
and one replica group per node (--devices 1).
Say things once (--trainer-flags): when TRAINING_COMMAND runs the package's trainer
(examples/train.py, python -m lightning_dist.workload.train), the --strategy, --devices,
--accelerator and (DDP family) --num-nodes it leaves out are appended from these options, and these
options, when not given, are taken from it; a value given on both sides must agree. Any other
command is run as it is, with a note (printed, and atop the script) of the Trainer arguments its
ranks need. A GPU task gets --cpus-per-task 8 (its DataLoader workers need cores) unless -c says
otherwise.
With requeue (default) SIGUSR1 comes --signal-seconds before --time: Lightning saves an hpc
checkpoint and requeues the job, which resumes from it; Elastic resumes from its commits.
Bad combinations are refused before anything is written."""

EPILOG = """\
examples:
  lightning-dist slurm -N 2 --devices 4 --accelerator gpu -p gpu -t 4:00:00 -A proj \\
      --setup 'module load cuda' --setup 'source .venv/bin/activate' -- python examples/train.py
      # runs: python examples/train.py --strategy ld_ddp --devices 4 --accelerator gpu --num-nodes 2
  lightning-dist slurm --devices 2 --submit -- python examples/train.py --strategy ld_horovod_adasum
  lightning-dist slurm -N 4 --min-nodes 2 --devices 8 --gres gpu:a100:8 --strategy ld_elastic \\
      --sbatch-arg --exclude=n07 --mail-type END,FAIL -- python train.py --devices 8"""


class _SlurmParser(argparse.ArgumentParser):
    """Reads ``--sbatch-arg --x=y`` (and ``--setup -x``) as the option and its value: argparse alone
    takes a separate word that starts with ``-`` for an option of its own ("expected one argument")."""

    @override
    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is not None:
            words, args = list(args), []
            while words:
                word = words.pop(0)
                args.append(
                    f"{word}={words.pop(0)}" if word in ("--sbatch-arg", "--setup") and words else word
                )
        return super().parse_known_args(args, namespace)


TEXT_OPTIONS: tuple[tuple[str, str, Optional[str], str], ...] = (
    ("-p", "--partition", None, "#SBATCH --partition; default the cluster's"),
    (
        "-t",
        "--time",
        None,
        "time limit, SLURM format (e.g. 30, 4:00:00, 1-12); default none (the partition's)",
    ),
    ("-J", "--job-name", "lightning-dist", "#SBATCH --job-name; default lightning-dist"),
    ("-A", "--account", None, "#SBATCH --account to charge; default your default account"),
    ("-q", "--qos", None, "#SBATCH --qos; default the account's"),
    (
        "-C",
        "--constraint",
        None,
        "#SBATCH --constraint, node features (e.g. a100, 'a100&ib', '[rack1|rack2]'); default none",
    ),
)
"""The plain one-value options of ``lightning-dist slurm``: short and long flag, default, help."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = sub.add_parser(
        "slurm",
        help="write (and --submit) an sbatch script for a strategy; the training command follows `--`",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="lightning-dist slurm [options] -- TRAINING_COMMAND ...",
    )
    if type(p) is argparse.ArgumentParser:
        p.__class__ = _SlurmParser
    from_command = (
        "default: the training command's {flag} when it has one (see --trainer-flags), else {default}"
    )
    p.add_argument(
        "-N",
        "--nodes",
        type=int,
        default=None,
        help="nodes (#SBATCH --nodes; the Trainer's num_nodes); "
        + from_command.format(flag="--num-nodes", default=1),
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices per node, GPUs or CPU processes, one rank (SLURM task) each: #SBATCH --ntasks-per-node "
        "(Elastic: one task per node running torchrun --nproc-per-node=DEVICES), with --accelerator gpu "
        "also --gpus-per-node; the Trainer's devices (Horovod: 1 per rank); "
        + from_command.format(flag="--devices", default=1)
        + " (Horovod: not taken, the command's is 1 per rank)",
    )
    p.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        default=None,
        help="cpu or gpu: with gpu, --gpus-per-node defaults to --devices and the training command gets "
        "--accelerator gpu; default: gpu when --gpus-per-node, a GPU --gres or the training command's "
        "--accelerator ask for GPUs, else cpu",
    )
    p.add_argument(
        "--strategy",
        default=None,
        help="strategy name: ld_ddp, ld_ddp_adasum, ld_compressed_<name>, ld_diloco, ld_sharded, ld_horovod, "
        "ld_horovod_adasum, ld_elastic, ld_fault_tolerant (`lightning-dist strategies` lists them all), a class "
        "name (DDP, Compressed, DiLoCo, Sharded, ShardedDiLoCo, Horovod, HorovodAdasum, Elastic, ElasticDiLoCo, "
        "FaultTolerant, FaultTolerantDiLoCo), "
        "'lightning_dist:Class(kw=...)' or "
        "Lightning's ddp; decides how the ranks start; "
        + from_command.format(flag="--strategy", default="ld_ddp"),
    )
    p.add_argument(
        "--trainer-flags",
        choices=TRAINER_FLAG_MODES,
        default="auto",
        help="the training command's --strategy/--devices/--accelerator/--num-nodes: auto (default): when it "
        "runs the package's trainer (examples/train.py, python -m lightning_dist.workload.train) the ones "
        "it leaves out are appended from the job (--num-nodes for the DDP family only: Horovod and Elastic "
        "take the node count from MPI and the rendezvous), the ones it gives must agree with the job, "
        "and unset options here are taken from them; always: the same for any command (your script takes "
        "these flags as examples/train.py does); never: the command is left as it is",
    )
    for short, option, default, text in TEXT_OPTIONS:
        p.add_argument(short, option, default=default, help=text)
    p.add_argument(
        "--exclusive",
        nargs="?",
        const=True,
        default=False,
        choices=EXCLUSIVE,
        help="#SBATCH --exclusive: whole nodes, shared with no other job; --exclusive=user|mcs|topo: "
        "SLURM's variants; default off (the partition's sharing)",
    )
    p.add_argument(
        "-o",
        "--output",
        default="%x-%j.out",
        help="output file, SLURM patterns, appended across requeues; default %%x-%%j.out",
    )
    p.add_argument(
        "-c",
        "--cpus-per-task",
        type=int,
        default=None,
        help=f"CPUs per rank (Elastic: per worker), for its dataloader workers; default {GPU_CPUS_PER_TASK} per "
        "GPU task (with --accelerator gpu), SLURM's (1) for CPU ranks",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node (>= --devices; every task sees all of them); default --devices with "
        "--accelerator gpu, else 0",
    )
    p.add_argument(
        "--gres",
        default=None,
        help="#SBATCH --gres, generic resources (e.g. gpu:4, gpu:a100:4, gpu:2,nvme:1); a GPU count here "
        "replaces --gpus-per-node (then it is not written); default none",
    )
    p.add_argument("--mem", default=None, help="memory per node, e.g. 64G; default SLURM's")
    p.add_argument(
        "--mail-type",
        default=None,
        help=f"#SBATCH --mail-type, comma-separated: {', '.join(MAIL_TYPES)}; default none (no mail)",
    )
    p.add_argument(
        "--mail-user",
        default=None,
        help="#SBATCH --mail-user (needs --mail-type); default the submitting user",
    )
    p.add_argument(
        "--setup",
        action="append",
        default=None,
        metavar="LINE",
        help="a shell line the batch script runs before the launch, e.g. 'module load cuda' or "
        "'source .venv/bin/activate' (the ranks inherit its environment); repeat for more lines, run in "
        "order; default none",
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=None,
        metavar="ARG",
        help="another sbatch option, written as '#SBATCH ARG' (e.g. --sbatch-arg --exclude=n07; a bare "
        "reservation=r1 gets '--'); one option each, repeatable; options written from the ones above are "
        "refused; default none",
    )
    p.add_argument(
        "--signal-seconds",
        type=int,
        default=90,
        help="seconds before the time limit that SIGUSR1 comes (save + requeue); default 90",
    )
    p.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--requeue (default): requeue on the signal and resume; --no-requeue: neither",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="Elastic: rendezvous port (default 30000 + job id mod 10000); DDP: MASTER_PORT (default Lightning's, "
        "from the job id)",
    )
    p.add_argument(
        "--master-addr",
        default=None,
        help="address of the first node when its host name does not resolve (MASTER_ADDR, Elastic's "
        "rendezvous); default the first node's host name",
    )
    p.add_argument(
        "--mpi",
        choices=MPI_LAUNCHES,
        default=None,
        help="Horovod only: auto (default: srun --mpi=pmix when `srun --mpi=list` has it, else mpirun), pmix, pmi2, "
        "mpirun",
    )
    p.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        help="Elastic only: keep training down to this many nodes (torchrun --nnodes=MIN:NODES); default "
        "none (always --nodes)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=3, help="Elastic only: torchrun --max-restarts; default 3"
    )
    p.add_argument(
        "-D",
        "--chdir",
        default=None,
        help="working directory of the job (Lightning's default_root_dir: hpc checkpoints, Elastic commits); "
        "default the submission directory",
    )
    p.add_argument(
        "--script",
        default=None,
        help="where to write the script ('-': print it); default ./<job-name>.sbatch",
    )
    p.add_argument(
        "--submit",
        action="store_true",
        help="submit it with sbatch and print the job id; default: only write",
    )
    return p


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
            horovod = resolve_strategy(strategy).family == "horovod"  # the command's devices is 1 per rank
            devices = int((None if horovod else take("--devices", str.isdigit)) or 1)
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
