"""The training command's Trainer flags (``--trainer-flags``): which command takes them, the values that
follow from the job, filling in the ones it leaves out and refusing one that disagrees."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Optional

from lightning_dist.launch.slurm_options import SlurmOptions, gres_gpus
from lightning_dist.launch.slurm_strategy import class_needs

TRAINER_FLAGS = ("--strategy", "--devices", "--accelerator", "--num-nodes")
"""The training command's flags that follow from the job (``--trainer-flags``)."""
WORKLOAD_SCRIPTS = ("examples/train.py", "examples/quickstart.py", "lightning_dist/workload/train.py")
WORKLOAD_MODULE = "lightning_dist.workload.train"
"""The package's trainer (``lightning_dist.workload.train.parse_args``): it takes ``TRAINER_FLAGS``."""


def is_python(arg: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)*)?", os.path.basename(arg)) is not None


def runs_workload_trainer(command: Sequence[str]) -> bool:
    """Whether ``command`` runs the package's trainer (``python [opts] examples/train.py ...`` or
    ``python -m lightning_dist.workload.train ...``), whose ``TRAINER_FLAGS`` are known."""
    if not command or not is_python(command[0]):
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


def trainer_strategy(spec: str) -> str:
    """``--strategy`` as the package's trainer takes it: a class name is ``lightning_dist:Class``."""
    return f"lightning_dist:{spec}" if spec in class_needs() else spec


def same_strategy(a: str, b: str) -> bool:
    def canonical(spec: str) -> str:
        spec = trainer_strategy(spec.replace(" ", ""))
        return spec + "()" if ":" in spec and not spec.endswith(")") else spec

    return canonical(a) == canonical(b)


def wanted_flags(job: SlurmOptions) -> dict[str, str]:
    """The ``TRAINER_FLAGS`` values that follow from the job."""
    return {
        "--strategy": trainer_strategy(job.strategy),
        "--devices": "1" if job.needs.one_device_per_process else str(job.devices),
        "--accelerator": str(job.accelerator),
        "--num-nodes": str(job.nodes),
    }


def added_flag(job: SlurmOptions, flag: str) -> bool:
    """Whether ``flag`` is appended when the command leaves it out: a Trainer that learns the node count
    from MPI or the rendezvous is not given ``--num-nodes`` (checked, not added)."""
    return flag != "--num-nodes" or job.needs.trainer_num_nodes


def trainer_needs(job: SlurmOptions) -> str:
    """The Trainer arguments the job's ranks need, as Python (``strategy='ld_ddp', devices=4, ...``)."""
    spec = trainer_strategy(job.strategy)
    if spec.startswith("lightning_dist:"):
        expr = spec.partition(":")[2]
        strategy = expr if expr.endswith(")") else expr + "()"
    else:
        strategy = repr(spec)
    wanted = wanted_flags(job)
    parts = [f"strategy={strategy}", f"devices={wanted['--devices']}"]
    if added_flag(job, "--num-nodes"):
        parts.append(f"num_nodes={wanted['--num-nodes']}")
    parts.append(f"accelerator={wanted['--accelerator']!r}")
    return ", ".join(parts)


def unfilled_note(job: SlurmOptions) -> Optional[str]:
    """What a command that did not get the job's flags must do itself (None when it got them)."""
    if job.fills_trainer_flags:
        return None
    why = (
        "is not the package's trainer, so it is left as it is (--trainer-flags auto)"
        if job.trainer_flags == "auto"
        else "is left as it is (--trainer-flags never)"
    )
    return (
        f"the training command {why}: its Trainer needs {trainer_needs(job)} (given in the script, "
        "or as flags it reads; --trainer-flags always appends --strategy/--devices/--accelerator/--num-nodes "
        "to a command that takes them as examples/train.py does)"
    )


def with_trainer_flags(job: SlurmOptions) -> list[str]:
    """The command with the ``TRAINER_FLAGS`` it leaves out appended; one it gives must agree."""
    given = command_flags(job.command)
    mpi = job.needs.engine == "mpi"
    wanted = wanted_flags(job)
    devices = wanted["--devices"]
    fill = [f for f in TRAINER_FLAGS if f not in given and added_flag(job, f)]
    fix = "drop it from the training command (it is filled in from the job) or give the same value"
    for flag, value in given.items():
        if flag == "--strategy" and not same_strategy(value, job.strategy):
            raise ValueError(
                f"the training command has --strategy {value} but the job's --strategy is {job.strategy}: "
                "give it once (lightning-dist slurm takes the command's when it has none) or the same on "
                "both; for a strategy of your own, give --strategy the family that starts its ranks "
                "(e.g. ld_ddp) and --trainer-flags never"
            )
        if flag == "--devices" and value.strip() != devices:
            if mpi:
                raise ValueError(
                    f"the training command has --devices {value} but {job.strategy} (Horovod) runs one "
                    f"process per device: --devices={job.devices} ranks per node, each with the Trainer's "
                    "devices=1; drop --devices from the training command (it is filled in) or give 1"
                )
            raise ValueError(
                f"the training command has --devices {value} but --devices={job.devices}: the Trainer's "
                f"devices are the ranks (SLURM tasks) per node; {fix}"
            )
        if flag == "--num-nodes" and value.strip() != wanted[flag]:
            raise ValueError(f"the training command has --num-nodes {value} but --nodes={job.nodes}; {fix}")
        if flag == "--accelerator":
            said = {"gpu": "gpu", "cuda": "gpu", "cpu": "cpu", "auto": job.accelerator}.get(value.lower())
            if said != job.accelerator:
                why = (
                    f"--gres={job.gres}"
                    if job.gres and gres_gpus(job.gres)
                    else f"--gpus-per-node={job.gpus_per_node}"
                    if job.gpus_per_node
                    else "no GPUs asked for"
                )
                raise ValueError(
                    f"the training command has --accelerator {value} but the job's --accelerator is "
                    f"{job.accelerator} ({why}); the command may say cpu, gpu, cuda or auto: {fix}"
                )
    return [*job.command, *(word for f in fill for word in (f, wanted[f]))]
