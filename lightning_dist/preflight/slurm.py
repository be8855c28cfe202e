"""Does this SLURM job match the Trainer? Checked when a strategy sets up, before any process group.

Lightning takes the world size, ranks and node count of a SLURM job from SLURM's variables and the
per-node process count from ``Trainer(devices=...)``. When the two disagree the job hangs (ranks wait
for peers that never start), trains twice alone, or fails late with an unrelated error. The checks
here compare them and raise a ``ValueError`` naming the mismatch and the fix, on every rank (every
task sees the same variables), before the process group forms:

- ``check_slurm_matches``: Lightning's own process model (``DDP``, ``Compressed``, Lightning's
  ``SLURMEnvironment``): one task per device, ``--ntasks-per-node`` equal to ``devices``, nodes equal
  to ``num_nodes``, every task of a node seeing all the node's GPUs.
- ``check_slurm_mpi``: Horovod (MPI decides the world): ``srun --mpi=pmix`` or ``mpirun`` tasks
  versus Horovod's world size.

``check_ddp_under_slurm(strategy)`` and ``check_horovod_under_slurm(strategy)`` are the one-line
calls the strategies make from ``setup_environment``. Nothing is checked outside SLURM, under
torchrun (``TORCHELASTIC_RUN_ID``: the elastic agent decides the world) or when Lightning does not
use its ``SLURMEnvironment`` (an interactive allocation: job name ``bash``/``interactive``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

MPI_LAUNCH_VARS = ("PMIX_RANK", "PMI_RANK", "PMI_FD", "PMI_SIZE")
"""Set in tasks started by ``srun --mpi=pmix`` / ``--mpi=pmi2`` (and by mpirun)."""
MPIRUN_VARS = ("OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "HOROVOD_SIZE")
"""Set by OpenMPI's mpirun, MPICH/Intel's mpiexec (Hydra) and horovodrun."""


def under_slurm(env: Mapping[str, str]) -> bool:
    """A SLURM job, and not torchrun's elastic agent inside one."""
    in_job = "SLURM_JOB_ID" in env or "SLURM_NTASKS" in env
    return in_job and "TORCHELASTIC_RUN_ID" not in env


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name)
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


def _gpu_list(value: Optional[str]) -> Optional[list[str]]:
    if value is None:
        return None
    items = [v for v in value.replace(" ", "").split(",") if v]
    return [] if items in ([], ["NoDevFiles"]) else items


def _raise(owner: str, summary: str, problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"{owner}: this SLURM job does not match {summary}:\n{lines}")


def check_slurm_matches(
    num_nodes: int,
    devices: int,
    owner: str,
    *,
    device_type: str = "cpu",
    start_method: str = "popen",
    env: Optional[Mapping[str, str]] = None,
) -> None:
    """Raise a ``ValueError`` when the SLURM job cannot run ``Trainer(devices, num_nodes)`` with
    one task per device (Lightning's ``SLURMEnvironment``); do nothing outside SLURM.

    Args:
        num_nodes, devices: the Trainer's (``devices`` is the processes per node).
        owner: who asks, first in the message (the strategy's class name).
        device_type: ``"cuda"`` also checks that every task of a node sees ``devices`` GPUs.
        start_method: the strategy's; ``spawn``/``fork``/``forkserver`` start processes of their
            own, which under srun multiplies the ranks.
        env: the variables to read (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if not under_slurm(env):
        return
    job = env.get("SLURM_JOB_ID", "?")
    want = devices * num_nodes
    summary = f"Trainer(devices={devices}, num_nodes={num_nodes}), i.e. {want} processes"
    fix_srun = f"srun --nodes={num_nodes} --ntasks-per-node={devices}"
    ntasks = _int(env, "SLURM_NTASKS")
    per_node = _int(env, "SLURM_NTASKS_PER_NODE")
    nodes = next(
        (
            n
            for n in (_int(env, v) for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
            if n is not None
        ),
        None,
    )
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    problems: list[str] = []

    mpirun = next((v for v in MPIRUN_VARS if v in env), None)
    if mpirun is not None and not in_step:
        problems.append(
            f"started by an MPI launcher ({mpirun}={env[mpirun]}) inside SLURM job {job}: Lightning's "
            f"SLURMEnvironment takes every rank from SLURM_PROCID, which is {env.get('SLURM_PROCID', '?')} "
            f"on every process here; launch with `{fix_srun} python ...` instead (or pass "
            "cluster_environment=MPIEnvironment() to the strategy)"
        )
        _raise(owner, summary, problems)
    if not in_step and ntasks is not None and ntasks > 1:
        problems.append(
            f"this process is the batch script of job {job} itself (SLURM_STEP_ID is not set), but "
            f"Lightning reads the world size from SLURM_NTASKS={ntasks}: it would wait for {ntasks - 1} "
            f"rank(s) that never start; run the training command under srun: `{fix_srun} python ...`"
        )
        _raise(owner, summary, problems)
    if start_method in ("spawn", "fork", "forkserver"):
        problems.append(
            f"start_method={start_method!r} starts {devices} process(es) per task, but under SLURM each "
            "task already is one rank; use start_method='popen' (strategy 'ld_ddp' or 'ld_ddp_popen') "
            "under srun; for a notebook inside a SLURM job, pass cluster_environment=LightningEnvironment() "
            "(or start the kernel with SLURM_JOB_NAME=interactive) so Lightning ignores SLURM"
        )
    if ntasks is not None and ntasks > 1 and per_node is None:
        problems.append(
            f"srun --ntasks {ntasks} without --ntasks-per-node: Lightning needs "
            f"--ntasks-per-node={devices} to match devices={devices} (`{fix_srun}`)"
        )
    if per_node is not None and per_node != devices:
        problems.append(
            f"--ntasks-per-node={per_node} (SLURM_NTASKS_PER_NODE) but devices={devices}: Lightning runs one "
            f"task per device; set devices={per_node} in the Trainer, or use --ntasks-per-node={devices}"
        )
    if nodes is not None and nodes != num_nodes:
        problems.append(
            f"the job step runs on {nodes} node(s) (SLURM_NNODES) but num_nodes={num_nodes}: set "
            f"num_nodes={nodes} in the Trainer, or request --nodes={num_nodes}"
        )
    if ntasks is not None and ntasks != want and not problems:
        layout = env.get("SLURM_TASKS_PER_NODE", "?")
        problems.append(
            f"SLURM_NTASKS={ntasks} (tasks per node: {layout}) but devices x num_nodes = {devices} x "
            f"{num_nodes} = {want}: every node needs exactly {devices} task(s); use `{fix_srun}`"
        )
    if device_type == "cuda":
        visible = _gpu_list(env.get("CUDA_VISIBLE_DEVICES"))
        step_gpus = _gpu_list(env.get("SLURM_STEP_GPUS", env.get("SLURM_JOB_GPUS")))
        if visible is not None and len(visible) < devices:
            problems.append(
                f"this task sees {len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')}) "
                f"but devices={devices}: Lightning puts local rank r on cuda:r, so every task of a node "
                f"must see all {devices} GPUs; request --gpus-per-node={devices} (or --gres=gpu:{devices}) "
                "without --gpus-per-task or --gpu-bind"
            )
        elif step_gpus is not None and len(step_gpus) < devices:
            problems.append(
                f"the job step holds {len(step_gpus)} GPU(s) on this node (SLURM_STEP_GPUS) but "
                f"devices={devices}; request --gpus-per-node={devices}"
            )
    _raise(owner, summary, problems)


def check_slurm_mpi(
    owner: str,
    world_size: Union[int, Callable[[], int]],
    *,
    env: Optional[Mapping[str, str]] = None,
) -> None:
    """Raise a ``ValueError`` when a Horovod job under SLURM was not started as one MPI job of
    ``SLURM_NTASKS`` ranks; do nothing outside SLURM or under mpirun/horovodrun (they decide).

    ``world_size`` (Horovod's, or a callable that initialises Horovod and returns it) is read only
    after the launch variables are known to be right, so a plain ``srun`` is reported before MPI
    starts.
    """
    env = os.environ if env is None else env
    if not under_slurm(env) or any(v in env for v in MPIRUN_VARS):
        return
    job = env.get("SLURM_JOB_ID", "?")
    ntasks = _int(env, "SLURM_NTASKS") or 1
    summary = f"an MPI job of SLURM_NTASKS={ntasks} rank(s)"
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if not in_step:
        if ntasks > 1:
            _raise(
                owner,
                summary,
                [
                    f"this process is the batch script of job {job} itself (SLURM_STEP_ID is not set): it "
                    f"trains alone while the job holds {ntasks} tasks; launch it with "
                    f"`srun --mpi=pmix python ...` or `mpirun -np {ntasks} python ...`"
                ],
            )
        return
    if ntasks > 1 and not any(v in env for v in MPI_LAUNCH_VARS):
        _raise(
            owner,
            summary,
            [
                f"srun started {ntasks} tasks without an MPI plugin (no PMIX_RANK/PMI_RANK): each would "
                "start MPI alone; add --mpi=pmix (`srun --mpi=list` shows the plugins) or launch with mpirun"
            ],
        )
    size = world_size() if callable(world_size) else world_size
    if size != ntasks:
        _raise(
            owner,
            summary,
            [
                f"Horovod's world size is {size} but srun started {ntasks} tasks (SLURM_NTASKS): the MPI "
                "library did not join the tasks into one job; launch with `srun --mpi=pmix` (the plugin "
                "your MPI was built for) or mpirun"
            ],
        )


def _device_info(strategy: Any) -> tuple[int, str]:
    devices = list(getattr(strategy, "parallel_devices", None) or [])
    return max(1, len(devices)), (devices[0].type if devices else "cpu")


def check_ddp_under_slurm(strategy: Any) -> None:
    """``check_slurm_matches`` for a Lightning ``DDPStrategy`` (one call from ``setup_environment``);
    only when Lightning runs it with its ``SLURMEnvironment``."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not isinstance(getattr(strategy, "cluster_environment", None), SLURMEnvironment):
        return
    devices, device_type = _device_info(strategy)
    check_slurm_matches(
        int(strategy.num_nodes),
        devices,
        type(strategy).__name__,
        device_type=device_type,
        start_method=str(getattr(strategy, "_start_method", "popen")),
    )
    logger.debug(
        "%s: SLURM job %s matches the Trainer", type(strategy).__name__, os.environ.get("SLURM_JOB_ID")
    )


def check_horovod_under_slurm(strategy: Any) -> None:
    """``check_slurm_mpi`` for a Horovod strategy (one call at the start of ``setup_environment``)."""
    check_slurm_mpi(type(strategy).__name__, lambda: int(strategy.world_size))
