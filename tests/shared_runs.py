"""Fault-free runs that tests in several files compare with or read, each group launched once per
session (tests/conftest.py: ``shared_popen``, ``shared_torchrun``, ``shared_mpirun``), so a launch's
start-up (the processes, imports and rendezvous) is paid once, not by every file that needs a run.

Each group is one launch (tests/scripts/in_sequence.py) that runs its configurations one after
another in the same processes; each configuration seeds itself and starts with zeroed counters, so
its results are those of the same script run alone. A run's files are in ``group[name]``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers import MPIRUN_TWO_RANKS, run_in_sequence

BUDGET = 150
"""Seconds for one group's launch (the largest, torchrun's ten Elastic runs and one DDP run, about
60 s on 2 shared cores): at most half the 300 s timeout of any test that asks for a group first."""

POPEN: dict[str, list[str]] = {
    # test_ddp_strategy: DDP() == Lightning's "ddp" at accumulation 1 and 2
    "ddp_ref1": ["ddp_run.py", "--strategy", "ddp", "--accumulate", "1"],
    "ddp_ours1": ["ddp_run.py", "--strategy", "ld_ddp", "--accumulate", "1"],
    "ddp_ref2": ["ddp_run.py", "--strategy", "ddp", "--accumulate", "2"],
    "ddp_ours2": ["ddp_run.py", "--strategy", "ld_ddp", "--accumulate", "2"],
    # test_ddp_strategy: the comm hook's calls with and without accumulation
    "ddp_k1": ["ddp_run.py", "--strategy", "ld_ddp", "--accumulate", "1", "--max-steps", "4"],
    "ddp_k2": ["ddp_run.py", "--strategy", "ld_ddp", "--accumulate", "2", "--max-steps", "4"],
    # test_ddp_strategy (spawn, fork): DDP() launched by Lightning's popen launcher
    "DDP_popen_3": ["ddp_run.py", "--strategy", "DDP", "--start-method", "popen", "--max-steps", "3"],
    # test_ddp_strategy (torchrun), test_slurm (srun, sbatch): ld_ddp without a cluster launcher
    "ld_ddp_3": ["ddp_run.py", "--strategy", "ld_ddp", "--max-steps", "3"],
    "ld_ddp_4": ["ddp_run.py", "--strategy", "ld_ddp", "--max-steps", "4"],
    # test_horovod_strategy: Lightning's "ddp" with clipping, and at twice the learning rate
    "ddp_clip": ["ddp_run.py", "--strategy", "ddp", "--clip", "0.05", "--max-steps", "6"],
    "ddp_lr_x2": ["ddp_run.py", "--strategy", "ddp", "--lr", "0.006", "--max-steps", "12"],
    # test_slurm: the requeued job's run, uninterrupted and without SLURM
    "slurm_requeue": ["slurm_requeue.py"],
    # test_netns, test_slurm_two_nodes: the runs across nodes, on one host
    "netns_DDP": ["netns_train.py", "--strategy", "DDP", "--devices", "2"],
    "netns_powersgd": ["netns_train.py", "--strategy", "powersgd", "--devices", "2"],
}
"""Runs Lightning's own launcher starts (2 processes): name -> a script of tests/scripts and its flags."""
POPEN_FILES = {"ddp_metrics.json": ["metric_run.py", "--strategy", "ld_ddp"]}
"""test_ddp_strategy's metrics probe, which writes one file (``--out`` is that file)."""

ELASTIC = ["--commit-every", "3"]
TORCHRUN: dict[str, list[str]] = {
    # test_elastic: each reduction for 12 steps (also test_slurm's and test_netns's Elastic
    # reference: "average") and for the 24 steps of the 2 -> 1 -> 2 runs
    "average": ["elastic_run.py", *ELASTIC, "--max-steps", "12"],
    "powersgd": ["elastic_run.py", *ELASTIC, "--max-steps", "12", "--compression", "powersgd"],
    "adasum": ["elastic_run.py", *ELASTIC, "--max-steps", "12", "--reduce-op", "adasum"],
    "average_scale": ["elastic_run.py", *ELASTIC, "--max-steps", "24"],
    "powersgd_scale": ["elastic_run.py", *ELASTIC, "--max-steps", "24", "--compression", "powersgd"],
    "adasum_scale": ["elastic_run.py", *ELASTIC, "--max-steps", "24", "--reduce-op", "adasum"],
    # test_elastic: first parts that tests continue (a copy each): commits 3 and 6
    "stopped_after_7": ["elastic_run.py", *ELASTIC, "--max-steps", "7"],
    "stopped_after_6": ["elastic_run.py", *ELASTIC, "--max-steps", "6"],
    # test_elastic_diloco: ElasticDiLoCo(inner_steps=4), fault-free and its first 7 steps
    "diloco": ["elastic_run.py", *ELASTIC, "--max-steps", "12", "--diloco", "4"],
    "diloco_stopped_after_7": ["elastic_run.py", *ELASTIC, "--max-steps", "7", "--diloco", "4"],
    # test_ddp_strategy: DDP() under torchrun (the agent's store on a port the OS picks), last: it
    # reuses the process group the Elastic runs made, as Lightning does for a second fit
    "ld_ddp_3_torchrun": ["ddp_run.py", "--strategy", "ld_ddp", "--max-steps", "3"],
}
"""Runs under ``torchrun --standalone --nproc-per-node=2`` (Elastic needs torchelastic's agent)."""

MPIRUN: dict[str, list[str]] = {
    # test_slurm, test_netns, test_slurm_two_nodes: HorovodAdasum on one host
    "horovod_adasum_6": ["hvd_train.py", "--strategy", "horovod_adasum", "--max-steps", "6"],
    # test_horovod_strategy: Horovod's average with and without clipping, with auto lr scale
    "hvd_clip": ["hvd_train.py", "--strategy", "horovod", "--lr-scale", "1", "--clip", "0.05", "--max-steps", "6"],
    "hvd_noclip": ["hvd_train.py", "--strategy", "horovod", "--lr-scale", "1", "--max-steps", "6"],
    "hvd_auto_lr": ["hvd_train.py", "--strategy", "horovod", "--max-steps", "12"],
    # test_horovod_strategy: accumulation of 2 batches against the doubled batch, plain SGD
    **{
        f"hvd_{kind}-{strategy}": ["hvd_train.py", "--strategy", strategy, *flags, "--optimizer", "sgd",
                                   "--max-steps", "5"]
        for strategy in ("horovod", "horovod_adasum")
        for kind, flags in (("acc", ["--accumulate", "2"]), ("big", ["--batch-size", "8"]))
    },
}  # fmt: skip
"""Runs under ``mpirun -np 2`` (the MPI controller: Horovod's Adasum needs it)."""
MPIRUN_FILES = {"hvd_metrics.json": ["metric_run.py", "--strategy", "horovod", "--devices", "1"]}
"""test_horovod_strategy's metrics probe under Horovod."""

TORCHRUN_CMD = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0"]  # fmt: skip


def launch(
    root: Path, runs: dict[str, list[str]], files: dict[str, list[str]], launcher: list[str], **env: str
) -> dict[str, Path]:
    """``runs`` (each writing to ``root / name``) and then ``files`` (each writing the file
    ``root / name``) in one launch; name -> path."""
    every = {**runs, **files}
    run_in_sequence(
        [[*args, "--out", str(root / name)] for name, args in every.items()], BUDGET, launcher, **env
    )
    return {name: root / name for name in every}


def popen(root: Path) -> dict[str, Path]:
    return launch(root, POPEN, POPEN_FILES, [sys.executable])


def torchrun(root: Path) -> dict[str, Path]:
    return launch(root, TORCHRUN, {}, TORCHRUN_CMD)


def mpirun(root: Path) -> dict[str, Path]:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    return launch(root, MPIRUN, MPIRUN_FILES, [*MPIRUN_TWO_RANKS, sys.executable])
