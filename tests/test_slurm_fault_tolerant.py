"""The sbatch script `lightning-dist slurm` writes for FaultTolerant, run for real on this machine with
stand-ins for SLURM's commands (``scontrol`` names one node, ``srun`` starts one task per node with
``SLURM_NODEID`` set): its Lighthouse and its per-node launch lines start a job of one replica group of
``--devices 2`` processes per node, whose group with a killed process is restarted by its own torchrun
while the other keeps its processes, every step's samples once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ft_harness as ft
import pytest
from helpers import child_env

pytest.importorskip("torchft", reason="FaultTolerant needs torchft: pip install '.[ft]'")

from lightning_dist.launch.slurm import SlurmJob  # noqa: E402

SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && echo localhost
exit 0
"""
SRUN = """#!/bin/bash
# one task per node (SLURM_NNODES), SLURM_NODEID set; srun's own --options dropped
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rendered_fault_tolerant_job_runs_and_restarts_only_the_killed_group(tmp_path: Path) -> None:
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job = tmp_path / "job.sh"
    job.write_text(
        SlurmJob(["python", str(ft.SCRIPT)], nodes=2, devices=2, strategy="ld_fault_tolerant").render()
    )
    env = child_env(FT_OUT=str(out), FT_STEPS="12", FT_FAIL="1:4:1", SLURM_JOB_ID="4321",
                    SLURM_JOB_NODELIST="localhost", SLURM_NNODES="2")  # fmt: skip
    # the fake srun/scontrol, and this environment's python and torchft_lighthouse
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]])
    proc = subprocess.run(
        ["bash", str(job)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "[INFO] [torchft::lighthouse]" not in proc.stdout + proc.stderr, "the Lighthouse logs at INFO"
    for rank in (0, 1):
        assert [a for a, _ in ft.pids(out, 0, rank)] == [0], "the healthy group's process was restarted"
        assert [a for a, _ in ft.pids(out, 1, rank)] == [0, 1], (
            "group 1 loses a process at step 4 and restarts"
        )
    samples = ft.steps(out, ranks=2)
    assert sorted(samples) == list(range(12))
    for step, indices in samples.items():
        assert len(indices) == ft.GLOBAL_BATCH == len(set(indices)), f"step {step}: a sample lost or repeated"
