"""What a strategy needs from whoever starts its processes (``lightning-dist slurm`` reads it).

Each strategy class says it once, as ``launch_needs = <one of the constants below>``; a launcher
writes its script from those fields and never asks which class it has. A strategy of your own that
subclasses one of the pack's inherits its needs; one that starts differently sets its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

ENGINES = ("lightning", "mpi", "torchrun", "torchft")
"""Who starts the ranks, in the order ``lightning-dist slurm`` lists them: Lightning's own process
model (srun, one task per device), one MPI job (Horovod), torch's elastic agent per node, torchft's
Lighthouse and a replica-group launcher per node."""
FAMILIES = dict(zip(ENGINES, ("ddp", "horovod", "elastic", "fault_tolerant")))
"""The name each engine's strategies go by in a script's first comment and in ``lightning-dist slurm``."""


@dataclass(frozen=True)
class LaunchNeeds:
    """How a strategy's processes must be started."""

    engine: str
    """One of ``ENGINES``."""
    agent_per_node: bool = False
    """One task per node whose agent starts the node's processes (else one task per device)."""
    one_device_per_process: bool = False
    """Every process's Trainer has ``devices=1`` (else the devices of its node)."""
    trainer_num_nodes: bool = True
    """The Trainer is told ``num_nodes`` (else MPI or the rendezvous says how many nodes there are)."""
    resumes_from_commits: bool = False
    """A requeued run resumes from the strategy's own commits (else from Lightning's hpc checkpoint)."""
    exports: tuple[tuple[str, str, str], ...] = ()
    """Environment variables every process needs: (name, value, why)."""
    adasum: bool = False
    """Horovod's Adasum: a power-of-two number of ranks (of nodes, on GPUs)."""
    one_process: bool = False
    """One process per replica group: one device per node."""
    refused: Optional[str] = None
    """Why no launcher of this pack starts it (None: it can be launched)."""
    refused_options: tuple[tuple[str, Any, str], ...] = ()
    """(keyword, value, why): a class spec with ``keyword=value`` is refused, saying why."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"LaunchNeeds(engine={self.engine!r}); accepted: {', '.join(ENGINES)}")

    @property
    def family(self) -> str:
        """``ddp``, ``horovod``, ``elastic`` or ``fault_tolerant`` (``FAMILIES``)."""
        return FAMILIES[self.engine]


LIGHTNING = LaunchNeeds("lightning")
MPI = LaunchNeeds(
    "mpi",
    one_device_per_process=True,
    trainer_num_nodes=False,
    refused_options=(
        (
            "op",
            "adasum",
            "Horovod(op='adasum') is not a strategy; use 'lightning_dist:HorovodAdasum()' (or the name "
            "ld_horovod_adasum) for Horovod's Adasum",
        ),
    ),
)
MPI_ADASUM = replace(MPI, adasum=True, refused_options=())
TORCHRUN = LaunchNeeds(
    "torchrun",
    agent_per_node=True,
    trainer_num_nodes=False,
    resumes_from_commits=True,
    exports=(
        (
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
            "1",
            "torch's shared rendezvous store breaks when a node leaves and joins again: one store per agent",
        ),
    ),
)
TORCHFT = LaunchNeeds(
    "torchft",
    agent_per_node=True,
    one_device_per_process=True,
    trainer_num_nodes=False,
    resumes_from_commits=True,
)
TORCHFT_ONE_PROCESS = replace(TORCHFT, one_process=True)
HOROVODRUN_ELASTIC = replace(
    MPI,
    refused="HorovodElastic runs under horovodrun's elastic driver (horovodrun --min-np/--max-np "
    "--host-discovery-script, docs/horovod-elastic.md), which this script does not start: under srun, "
    "mpirun or torchrun every process would be Horovod's rank 0 of 1 and train alone; for elastic "
    "training under SLURM use ld_elastic (torchrun: restarts and world-size changes), or run horovodrun "
    "in an sbatch script of your own",
)
