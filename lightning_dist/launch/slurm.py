"""sbatch scripts for a strategy: ``lightning-dist slurm`` (and ``--submit``).

One script per job: N nodes x G devices, a strategy name (which decides how the ranks start) and the
training command. What each strategy family gets:

- DDP family (``ld_ddp``, ``DDP``, ``compressed_*``, ``Compressed``, Lightning's ``ddp``):
  ``srun --ntasks-per-node=G``: one task per device, Lightning's ``SLURMEnvironment`` reads the ranks.
- Horovod (``horovod*``, ``Horovod``, ``horovod_adasum``, ``HorovodAdasum``): one MPI job of N x G
  ranks: ``srun --mpi=pmix`` when SLURM has the PMIx plugin, otherwise ``mpirun`` over the job's nodes.
- Elastic (``elastic``, ``Elastic``): one ``torchrun`` per node, c10d rendezvous on the first node,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's shared rendezvous store loses the round when a
  node leaves and joins again).

Requeue (default): ``#SBATCH --requeue`` and a signal ``--signal-seconds`` before the time limit.
For the DDP and Horovod families SLURM sends SIGUSR1 to every task: Lightning's ``SLURMEnvironment``
(``auto_requeue=True``) saves ``<default_root_dir>/hpc_ckpt_<n>.ckpt`` and runs ``scontrol requeue``;
the requeued run's ``Trainer.fit`` resumes from the newest ``hpc_ckpt_*.ckpt`` by itself. For Elastic
(and Horovod under mpirun) the batch shell gets the signal (``B:``): Elastic resumes from its own
commits, so the script just requeues; under mpirun it forwards the signal to mpirun, which passes it
to the ranks.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

FAMILIES = ("ddp", "horovod", "elastic")
MPI_LAUNCHES = ("auto", "pmix", "pmi2", "mpirun")
CLASS_FAMILIES = {
    "DDP": ("ddp", False),
    "Compressed": ("ddp", False),
    "Elastic": ("elastic", False),
    "ElasticDiLoCo": ("elastic", False),
    "Horovod": ("horovod", False),
    "HorovodAdasum": ("horovod", True),
}
"""lightning_dist's strategy classes (``--strategy DDP`` or ``lightning_dist:DDP(...)``)."""
FORK_START_METHODS = ("spawn", "fork", "forkserver")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_NAME = re.compile(r"^[A-Za-z0-9_.,:@%+=-]+$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_HOST = re.compile(r"^[A-Za-z0-9_.:-]+$")


class _Raw(str):
    """A word of the script that the batch shell expands (``"$hosts"``): written unquoted."""


@dataclass(frozen=True)
class StrategyKind:
    """How a strategy's ranks start under SLURM."""

    name: str
    family: str
    """``ddp``, ``horovod`` or ``elastic``."""
    adasum: bool = False
    """Horovod's Adasum: needs a power-of-two number of ranks (of nodes on GPUs)."""


def _registry() -> tuple[dict[str, StrategyKind], dict[str, str]]:
    """Accepted registered names, and refused ones with the reason."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    import lightning_dist  # noqa: F401  (registers lightning_dist's strategy names)
    from lightning_dist.strategies import ElasticMixin, Horovod, HorovodAdasum

    kinds: dict[str, StrategyKind] = {}
    refused: dict[str, str] = {}
    for name in StrategyRegistry.available_strategies():
        entry = StrategyRegistry[name]
        cls, params = entry["strategy"], entry.get("init_params", {})
        if issubclass(cls, ElasticMixin):
            kinds[name] = StrategyKind(name, "elastic")
        elif issubclass(cls, HorovodAdasum):
            kinds[name] = StrategyKind(name, "horovod", adasum=True)
        elif issubclass(cls, Horovod):
            kinds[name] = StrategyKind(name, "horovod", adasum=params.get("op") == "adasum")
        elif cls is DDPStrategy or (
            issubclass(cls, DDPStrategy) and cls.__module__.startswith("lightning_dist.")
        ):
            # Lightning's own ddp and lightning_dist's DDP/Compressed (not DeepSpeed/XLA, DDP subclasses too)
            start = params.get("start_method", "popen")
            if start in FORK_START_METHODS:
                refused[name] = (
                    f"it starts its own processes (start_method={start!r}), but under SLURM srun starts "
                    "one task per device; use 'ld_ddp' (or 'ddp' for Lightning's own)"
                )
            else:
                kinds[name] = StrategyKind(name, "ddp")
    return kinds, refused


def accepted_strategies() -> list[str]:
    """The names ``--strategy`` accepts (registered names and lightning_dist's class names)."""
    kinds, _ = _registry()
    return _ordered(kinds)


def _ordered(kinds: dict[str, StrategyKind]) -> list[str]:
    """Registered names by family (DDP, Horovod, Elastic), then the class names."""
    order = {family: i for i, family in enumerate(FAMILIES)}
    names = sorted(kinds, key=lambda n: (order[kinds[n].family], not n.startswith(("ld_", "compressed_")), n))
    return names + sorted(CLASS_FAMILIES, key=lambda c: (order[CLASS_FAMILIES[c][0]], c))


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
    if class_name in CLASS_FAMILIES:
        family, adasum = CLASS_FAMILIES[class_name]
        if kwargs.get("start_method") in FORK_START_METHODS:
            raise ValueError(
                f"--strategy {spec!r}: start_method={kwargs['start_method']!r} starts its own processes, "
                "but under SLURM srun starts one task per device; leave start_method at 'auto' or 'popen'"
            )
        adasum = adasum or (class_name == "Horovod" and kwargs.get("op") == "adasum")
        return StrategyKind(spec, family, adasum)
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
    """Ranks per node (one per GPU or CPU process); the Trainer's ``devices`` (1 for Horovod)."""
    strategy: str = "ld_ddp"
    """Strategy name: decides how the ranks start (see the module docstring)."""
    partition: Optional[str] = None
    time: Optional[str] = None
    """Time limit (SLURM's format); the requeue signal comes ``signal_seconds`` before it."""
    job_name: str = "lightning-dist"
    output: str = "%x-%j.out"
    """Output file (SLURM's patterns); appended to across requeues."""
    cpus_per_task: Optional[int] = None
    """CPUs per rank (Elastic's one task per node gets ``devices`` times this)."""
    gpus_per_node: int = 0
    """GPUs per node (0: a CPU job); every task of a node sees all of them."""
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
        if self.gpus_per_node and self.gpus_per_node < self.devices:
            raise ValueError(
                f"--gpus-per-node={self.gpus_per_node} is fewer than --devices={self.devices}: each rank of a "
                f"node needs its own GPU; use --gpus-per-node={self.devices} (or fewer --devices)"
            )
        if self.kind.adasum:
            if self.gpus_per_node and not _power_of_two(self.nodes):
                raise ValueError(
                    f"--strategy {self.strategy} on GPUs needs a power-of-two number of nodes (Horovod's "
                    f"hierarchical Adasum), got --nodes={self.nodes}; use 1, 2, 4, 8... nodes, or "
                    "DDP(reduce_op='adasum') (any world size)"
                )
            if not self.gpus_per_node and not _power_of_two(ranks):
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
        if family == "ddp":
            self.launch = "srun"
        elif family == "elastic":
            self.launch = "torchrun"
        else:
            mpi = self.mpi or "auto"
            if mpi == "auto":
                mpi = "pmix" if pmix_available() else "mpirun"
            self.launch = "mpirun" if mpi == "mpirun" else f"srun-{mpi}"

    # -- the script --------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        return self.nodes * self.devices

    def _batch_signal(self) -> bool:
        """The batch shell takes the signal (Elastic: requeue; mpirun: forward it)."""
        return self.launch in ("torchrun", "mpirun")

    def header(self) -> list[str]:
        elastic = self.launch == "torchrun"
        lines = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={1 if elastic else self.devices}",
        ]
        if elastic:
            lines.append(f"--cpus-per-task={self.devices * (self.cpus_per_task or 1)}")
        elif self.cpus_per_task is not None:
            lines.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.gpus_per_node:
            lines.append(f"--gpus-per-node={self.gpus_per_node}")
        for name in ("partition", "time", "mem", "chdir"):
            value = getattr(self, name)
            if value is not None:
                lines.append(f"--{name}={value}")
        lines.append(f"--output={self.output}")
        if self.requeue:
            prefix = "B:" if self._batch_signal() else ""
            lines += ["--open-mode=append", f"--signal={prefix}SIGUSR1@{self.signal_seconds}", "--requeue"]
        else:
            lines.append("--no-requeue")
        return [f"#SBATCH {line}" for line in lines]

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
        }[self.launch]
        lines = [
            "#!/bin/bash",
            f"# Written by `lightning-dist slurm` (lightning_dist {__version__}): strategy {self.strategy} "
            f"({family} family), {self.nodes} node(s) x {self.devices} device(s) = {self.ranks} rank(s).",
            f"# {how}.",
            "# Submit: sbatch <this file>",
            *self.header(),
            "set -euo pipefail",
            'echo "lightning-dist: job ${SLURM_JOB_ID} run ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}"',
        ]
        if self.requeue and family != "elastic":
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
        if self.master_addr is not None and family != "elastic":
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
        launch = words(self.launch_command())
        if not (self.requeue and self._batch_signal()):
            lines.append(launch)
            return "\n".join(lines) + "\n"
        if self.launch == "torchrun":
            lines += [
                "on_signal() {",
                '  echo "lightning-dist: SIGUSR1 (time limit near): requeueing job $SLURM_JOB_ID; Elastic resumes from its last commit"',
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
`--`) with --nodes x --devices ranks of --strategy. How the ranks start depends on the strategy:
DDP/Compressed: `srun --ntasks-per-node=DEVICES` (the Trainer needs devices=DEVICES,
num_nodes=NODES); Horovod/HorovodAdasum: one MPI job (`srun --mpi=pmix`, else mpirun; the Trainer
has devices=1); Elastic: one torchrun per node with a c10d rendezvous on the first node.
With requeue (default) SIGUSR1 comes --signal-seconds before --time: Lightning saves an hpc
checkpoint and requeues the job, which resumes from it; Elastic resumes from its commits.
Bad combinations are refused before anything is written."""

EPILOG = """\
examples:
  lightning-dist slurm --nodes 2 --devices 4 --gpus-per-node 4 --strategy ld_ddp --time 4:00:00 \\
      -- python examples/train.py --strategy ld_ddp --accelerator gpu --devices 4 --num-nodes 2
  lightning-dist slurm --nodes 1 --devices 2 --strategy horovod_adasum --submit \\
      -- python examples/train.py --strategy horovod_adasum --devices 1
  lightning-dist slurm --nodes 4 --min-nodes 2 --devices 8 --strategy elastic -- python train.py"""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p = sub.add_parser(
        "slurm",
        help="write (and --submit) an sbatch script for a strategy; the training command follows `--`",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="lightning-dist slurm [options] -- TRAINING_COMMAND ...",
    )
    p.add_argument(
        "--nodes", type=int, default=1, help="nodes to run on (the Trainer's num_nodes); default 1"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="ranks per node, one per GPU or CPU process (the Trainer's devices; 1 for Horovod); default 1",
    )
    p.add_argument(
        "--strategy",
        default="ld_ddp",
        help="strategy name: ld_ddp, ld_ddp_adasum, compressed_<name>, horovod, horovod_adasum, elastic, "
        "a class name (DDP, Compressed, Horovod, HorovodAdasum, Elastic), 'lightning_dist:Class(kw=...)' or "
        "Lightning's ddp; decides how the ranks start; default ld_ddp",
    )
    p.add_argument("--partition", default=None, help="#SBATCH --partition (default: the cluster's default)")
    p.add_argument(
        "--time", default=None, help="time limit, SLURM format (e.g. 30, 4:00:00, 1-12); default none"
    )
    p.add_argument("--job-name", default="lightning-dist", help="#SBATCH --job-name; default lightning-dist")
    p.add_argument(
        "--output",
        default="%x-%j.out",
        help="output file, SLURM patterns, appended across requeues; default %%x-%%j.out",
    )
    p.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs per rank (Elastic: per worker); default SLURM's (1)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs per node for GPU boxes (>= --devices; every task sees all of them); default 0 (CPU)",
    )
    p.add_argument("--mem", default=None, help="memory per node, e.g. 64G; default SLURM's")
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
        help="address of the first node when its host name does not resolve (MASTER_ADDR, Elastic's rendezvous)",
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
        help="Elastic only: keep training down to this many nodes (torchrun --nnodes=MIN:NODES)",
    )
    p.add_argument(
        "--max-restarts", type=int, default=3, help="Elastic only: torchrun --max-restarts; default 3"
    )
    p.add_argument(
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
    p.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    return p


def run(args: argparse.Namespace, command: list[str]) -> int:
    """The ``slurm`` subcommand: build (checks first), write, maybe submit."""
    try:
        job = SlurmJob(
            command=command,
            nodes=args.nodes,
            devices=args.devices,
            strategy=args.strategy,
            partition=args.partition,
            time=args.time,
            job_name=args.job_name,
            output=args.output,
            cpus_per_task=args.cpus_per_task,
            gpus_per_node=args.gpus_per_node,
            mem=args.mem,
            signal_seconds=args.signal_seconds,
            requeue=args.requeue,
            port=args.port,
            master_addr=args.master_addr,
            mpi=args.mpi,
            min_nodes=args.min_nodes,
            max_restarts=args.max_restarts,
            chdir=args.chdir,
        )
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
