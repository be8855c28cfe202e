"""The SLURM environment check: every mismatch between SLURM's variables and the Trainer is a
ValueError naming it and the fix; a matching job, or no SLURM at all, passes (fast: env dicts and
strategies with a monkeypatched environment, no processes)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from lightning_dist import DDP
from lightning_dist.preflight.slurm import (
    check_ddp_under_slurm,
    check_horovod_under_slurm,
    check_slurm_matches,
    check_slurm_mpi,
    under_slurm,
)


def srun_env(**extra: str) -> dict[str, str]:
    """A task of `srun --nodes=1 --ntasks-per-node=2` (what SLURM 22.05 sets, seen on the local cluster)."""
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "vm",
    }
    env.update(extra)
    return env


def without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


def mismatch(**kwargs: Any) -> str:
    env = kwargs.pop("env")
    with pytest.raises(ValueError) as info:
        check_slurm_matches(kwargs.pop("num_nodes", 1), kwargs.pop("devices", 2), "DDP", env=env, **kwargs)
    return str(info.value)


def step_env(nodes: int, ntasks: int, **extra: str) -> dict[str, str]:
    """``srun_env`` of a job step of ``ntasks`` tasks on ``nodes`` nodes."""
    return srun_env(
        SLURM_NTASKS=str(ntasks), SLURM_NNODES=str(nodes), SLURM_STEP_NUM_NODES=str(nodes), **extra
    )


# -- Lightning's process model (DDP, Compressed) -----------------------------------------------------
def test_matching_job_and_no_slurm_pass() -> None:
    check_slurm_matches(1, 2, "DDP", env=srun_env())
    check_slurm_matches(2, 4, "DDP", env=step_env(2, 8, SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NUM_NODES="2"))
    check_slurm_matches(1, 8, "DDP", env={})  # not a SLURM job: nothing to compare
    check_slurm_matches(1, 8, "DDP", env=srun_env(TORCHELASTIC_RUN_ID="x"))  # torchrun decides the world
    check_slurm_matches(
        1, 1, "DDP", env=without(srun_env(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1"), "SLURM_STEP_ID")
    )
    assert (
        under_slurm(srun_env()) and not under_slurm({}) and not under_slurm(srun_env(TORCHELASTIC_RUN_ID="1"))
    )


def test_ntasks_without_ntasks_per_node() -> None:
    msg = mismatch(env=without(srun_env(), "SLURM_NTASKS_PER_NODE"))
    assert msg.startswith("DDP: this SLURM job does not match Trainer(devices=2, num_nodes=1)")
    assert (
        "srun --ntasks 2 without --ntasks-per-node: Lightning needs --ntasks-per-node=2 to match devices=2"
        in msg
    )
    assert "srun --nodes=1 --ntasks-per-node=2" in msg


def test_ntasks_per_node_differs_from_devices() -> None:
    msg = mismatch(env=srun_env(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="4"), devices=2)
    assert "--ntasks-per-node=4 (SLURM_NTASKS_PER_NODE) but devices=2" in msg
    assert "set devices=4 in the Trainer, or use --ntasks-per-node=2" in msg


def test_nodes_differ_from_num_nodes() -> None:
    env = step_env(2, 4, SLURM_JOB_NUM_NODES="2")
    msg = mismatch(env=env, devices=2, num_nodes=1)
    assert "the job step runs on 2 node(s) (SLURM_NNODES) but num_nodes=1" in msg
    assert "set num_nodes=2 in the Trainer, or request --nodes=1" in msg


def test_ntasks_differs_from_devices_times_nodes() -> None:
    # srun -N 2 -n 3: tasks per node "2,1"; SLURM_NTASKS_PER_NODE not set but -n given
    env = step_env(2, 3, SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="2,1")
    msg = mismatch(env=env, devices=2, num_nodes=2)
    assert "SLURM_NTASKS=3 (tasks per node: 2,1) but devices x num_nodes = 2 x 2 = 4" in msg
    # one task for two devices
    msg = mismatch(env=srun_env(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1"), devices=2)
    assert "--ntasks-per-node=1 (SLURM_NTASKS_PER_NODE) but devices=2" in msg


def test_python_run_in_the_batch_script_itself() -> None:
    msg = mismatch(env=without(srun_env(), "SLURM_STEP_ID"))
    assert "is the batch script of job 42 itself (SLURM_STEP_ID is not set)" in msg
    assert "would wait for 1 rank(s) that never start" in msg and "srun --nodes=1 --ntasks-per-node=2" in msg


def test_mpirun_inside_a_slurm_job() -> None:
    env = without(srun_env(OMPI_COMM_WORLD_SIZE="2"), "SLURM_STEP_ID")
    msg = mismatch(env=env)
    assert "started by an MPI launcher (OMPI_COMM_WORLD_SIZE=2) inside SLURM job 42" in msg
    assert "SLURM_PROCID, which is 0 on every process here" in msg and "MPIEnvironment()" in msg


def test_fork_start_methods_under_srun() -> None:
    for method in ("fork", "spawn", "forkserver"):
        msg = mismatch(env=srun_env(), start_method=method)
        assert f"start_method={method!r} starts 2 process(es) per task" in msg and "'ld_ddp'" in msg
    check_slurm_matches(1, 2, "DDP", env=srun_env(), start_method="popen")


def test_gpus_isolated_per_task() -> None:
    # --gpus-per-task=1: each task sees one GPU, Lightning wants cuda:<local rank>
    msg = mismatch(env=srun_env(CUDA_VISIBLE_DEVICES="0", SLURM_STEP_GPUS="0,1"), device_type="cuda")
    assert "this task sees 1 GPU(s) (CUDA_VISIBLE_DEVICES=0) but devices=2" in msg
    assert "--gpus-per-node=2 (or --gres=gpu:2) without --gpus-per-task or --gpu-bind" in msg
    # the step holds fewer GPUs than devices
    msg = mismatch(env=srun_env(SLURM_STEP_GPUS="3"), device_type="cuda")
    assert "the job step holds 1 GPU(s) on this node (SLURM_STEP_GPUS) but devices=2" in msg
    check_slurm_matches(
        1, 2, "DDP", env=srun_env(CUDA_VISIBLE_DEVICES="0,1", SLURM_STEP_GPUS="0,1"), device_type="cuda"
    )
    # a CPU job does not look at GPUs
    check_slurm_matches(1, 2, "DDP", env=srun_env(CUDA_VISIBLE_DEVICES="0"), device_type="cpu")


def test_every_problem_is_listed() -> None:
    env = srun_env(SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2")
    msg = mismatch(env=env, devices=2, num_nodes=1, start_method="spawn")
    assert msg.count("\n  - ") == 3


# -- Horovod (MPI) -----------------------------------------------------------------------------------
def test_mpi_job_matches() -> None:
    check_slurm_mpi("HorovodAdasum", 2, env=srun_env(PMIX_RANK="0"))
    check_slurm_mpi("HorovodAdasum", lambda: 2, env=srun_env(PMI_RANK="0"))
    check_slurm_mpi(
        "Horovod", 4, env=without(srun_env(OMPI_COMM_WORLD_SIZE="4"), "SLURM_STEP_ID")
    )  # mpirun decides
    check_slurm_mpi("Horovod", 1, env={})
    check_slurm_mpi("Horovod", 1, env=srun_env(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1"))


def test_srun_without_mpi_plugin() -> None:
    def never() -> int:
        raise AssertionError(
            "the world size must not be read (MPI would start alone) before this is reported"
        )

    with pytest.raises(ValueError) as info:
        check_slurm_mpi("HorovodAdasum", never, env=srun_env())
    msg = str(info.value)
    assert msg.startswith("HorovodAdasum: this SLURM job does not match an MPI job of SLURM_NTASKS=2 rank(s)")
    assert "srun started 2 tasks without an MPI plugin (no PMIX_RANK/PMI_RANK)" in msg and "--mpi=pmix" in msg


def test_mpi_world_size_differs_from_tasks() -> None:
    with pytest.raises(
        ValueError, match=r"Horovod's world size is 1 but srun started 2 tasks \(SLURM_NTASKS\)"
    ):
        check_slurm_mpi("Horovod", 1, env=srun_env(PMIX_RANK="0"))


def test_horovod_run_in_the_batch_script() -> None:
    with pytest.raises(
        ValueError, match=r"batch script of job 42 itself .* trains alone while the job holds 2 tasks"
    ):
        check_slurm_mpi("Horovod", 1, env=without(srun_env(), "SLURM_STEP_ID"))


# -- the strategies' one call ------------------------------------------------------------------------
def ddp_strategy(devices: int, num_nodes: int, environment: Any, start_method: str = "popen") -> DDP:
    strategy = DDP(start_method=start_method, cluster_environment=environment)  # type: ignore[arg-type]
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    return strategy


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "OMPI_", "PMIX_", "PMI_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_ddp_strategy_check_reads_its_devices_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, srun_env(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="4"))
    with pytest.raises(
        ValueError, match=r"(?s)^DDP: .*--ntasks-per-node=4 \(SLURM_NTASKS_PER_NODE\) but devices=2"
    ):
        check_ddp_under_slurm(ddp_strategy(2, 1, SLURMEnvironment()))
    check_ddp_under_slurm(ddp_strategy(4, 1, SLURMEnvironment()))
    # Lightning not on SLURMEnvironment (interactive allocation, or a given environment): not checked
    check_ddp_under_slurm(ddp_strategy(2, 1, LightningEnvironment()))
    with pytest.raises(ValueError, match="start_method='fork' starts 4 process"):
        check_ddp_under_slurm(ddp_strategy(4, 1, SLURMEnvironment(), start_method="fork"))


def test_trainer_fit_fails_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python train.py` straight in an sbatch script of 2 tasks: Lightning's own SLURM checks pass
    (ntasks-per-node = devices, nodes = num_nodes) and rank 0 would wait for a rank 1 that never
    starts; DDP.setup_environment raises before torch.distributed is initialised."""
    set_env(monkeypatch, without(srun_env(), "SLURM_STEP_ID"))
    from lightning_dist.workload import TinyCausalLM, WorkloadConfig

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDP(timeout=timedelta(seconds=5)),  # were the check to pass: a quick failure, not a hang
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    with pytest.raises(
        ValueError, match=r"is the batch script of job 42 itself \(SLURM_STEP_ID is not set\)"
    ):
        trainer.fit(TinyCausalLM(WorkloadConfig.tiny()))
    assert not torch.distributed.is_initialized()


class FakeHorovod:
    """What check_horovod_under_slurm reads from a Horovod strategy."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


def test_horovod_strategy_check(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, srun_env(PMIX_RANK="0"))
    check_horovod_under_slurm(FakeHorovod(2))
    with pytest.raises(ValueError, match=r"(?s)^FakeHorovod: .*world size is 1 but srun started 2 tasks"):
        check_horovod_under_slurm(FakeHorovod(1))
