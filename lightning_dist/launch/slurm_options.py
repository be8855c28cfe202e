"""The options of one sbatch script, as given, and what follows from them (``SlurmJob`` checks them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_dist.strategies.launch_needs import LaunchNeeds


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
