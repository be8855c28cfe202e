"""Was this Horovod job started by a launcher? Checked when a Horovod strategy sets up.

A Horovod strategy starts no processes: horovodrun, mpirun or ``srun --mpi`` start one per device and
Horovod joins them. ``python train.py`` with ``Trainer(devices=2)`` would therefore train at world
size 1, alone, on one device. ``check_horovod_launched`` refuses that with the command to use; with
``devices=1`` and no launcher, world size 1 is a normal case and it says so in one info line. Under a
launcher the launcher decides the world (an elastic job may shrink to one worker): nothing is checked.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Optional, Union

from lightning_dist.preflight.slurm import MPI_LAUNCH_VARS, MPIRUN_VARS

logger = logging.getLogger(__name__)

LAUNCHER_VARS = (
    *MPIRUN_VARS,
    *MPI_LAUNCH_VARS,
    "OMPI_COMM_WORLD_RANK",
    "HOROVOD_RANK",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_ELASTIC",
)
"""Set in a process that horovodrun (over MPI or Gloo, elastic too: its workers learn their rank at the
rendezvous), mpirun/mpiexec or ``srun --mpi`` started."""


ALTERNATIVES = {
    "Horovod": "DDP() (strategy='ld_ddp')",
    "HorovodAdasum": "DDP(reduce_op='adasum') (strategy='ld_ddp_adasum')",
    "HorovodElastic": "Elastic() (strategy='ld_elastic'; torchrun for a changing world)",
}
"""What trains the same way on processes Lightning starts, per Horovod strategy."""


def _script() -> str:
    """The running script, for the commands in the messages (``train.py`` where there is none)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0 if argv0.endswith(".py") else "train.py"


def launch_commands(owner: str, processes: Union[int, str]) -> str:
    """The commands that start ``processes`` ranks of ``owner``'s script (``N`` for any count)."""
    script = _script()
    if owner == "HorovodAdasum":  # Adasum needs Horovod's MPI controller
        return (
            f"`horovodrun --mpi -np {processes} python {script}` or `mpirun -np {processes} python {script}`"
        )
    if owner == "HorovodElastic":
        return (
            f"`horovodrun -np {processes} --min-np 1 --max-np {processes} --host-discovery-script "
            f"./discover.sh python {script}` (the script calling "
            "lightning_dist.launch.horovod_elastic.fit_horovod_elastic), or, without elasticity, "
            f"`mpirun -np {processes} python {script}`"
        )
    return f"`horovodrun -np {processes} python {script}` or `mpirun -np {processes} python {script}`"


def check_horovod_launched(
    owner: str,
    world_size: int,
    devices: int,
    num_nodes: int = 1,
    env: Optional[Mapping[str, str]] = None,
) -> None:
    """Raise a ``ValueError`` when ``Trainer(devices, num_nodes)`` asks for more than one process but
    no launcher started this one (Horovod's ``world_size`` is 1); log one info line when one device
    trains alone without a launcher; do nothing under a launcher.

    Args:
        owner: the strategy's class name (first in the message; picks the launch command).
        world_size: Horovod's, read after ``hvd.init()``.
        devices, num_nodes: the Trainer's.
        env: the variables to read (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if world_size > 1 or any(v in env for v in LAUNCHER_VARS):
        return
    wanted = devices * num_nodes
    if wanted <= 1:
        logger.info(
            "%s: world size 1 (this process was not started by horovodrun or mpirun); to train on N "
            "processes launch it with %s",
            owner,
            launch_commands(owner, "N"),
        )
        return
    asked = f"devices={devices}" + (f", num_nodes={num_nodes}" if num_nodes != 1 else "")
    raise ValueError(
        f"{owner}: Trainer({asked}) asks for {wanted} processes, but Horovod's world size is 1: this "
        "process was not started by horovodrun or mpirun, and a Horovod strategy starts no processes "
        f"itself, so it would train alone on one device. Launch one process per device with "
        f"Trainer(devices=1): {launch_commands(owner, wanted)}; or let Lightning start the {wanted} "
        f"processes with {ALTERNATIVES.get(owner, ALTERNATIVES['Horovod'])}"
    )


def check_strategy_launched(strategy: Any) -> None:
    """``check_horovod_launched`` for a Horovod strategy (one call from ``setup_environment``)."""
    devices = max(1, len(getattr(strategy, "parallel_devices", None) or []))
    check_horovod_launched(
        type(strategy).__name__,
        int(strategy.world_size),
        devices,
        int(getattr(strategy, "num_nodes", 1) or 1),
    )
