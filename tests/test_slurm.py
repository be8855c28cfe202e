"""srun launch on a real one-node SLURM cluster (started here by scripts/start-local-slurm.sh as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, SCRIPTS, assert_same_weights, load_rank, run_command, run_script

pytestmark = pytest.mark.slow
START = ROOT / "scripts" / "start-local-slurm.sh"
START_BUDGET = 120
"""Seconds to start the cluster (about 1 s here; more when it installs the packages), inside the
first test's 300 s timeout."""
BUDGET = 90
"""Seconds for one 2-process run (a few seconds here): start + 2 runs stay below the test timeout."""


@pytest.fixture(scope="module")
def slurm_conf() -> Iterator[str]:
    if os.environ.get("SLURM_CONF") and shutil.which("srun"):
        yield os.environ["SLURM_CONF"]
        return
    if os.geteuid() != 0 or shutil.which("srun") is None:
        pytest.skip("needs SLURM (apt-get install slurmctld slurmd slurm-client munge) and root to start it")
    proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=START_BUDGET)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = proc.stdout.strip().splitlines()[-1].split("=", 1)[1]
    yield conf
    subprocess.run(["bash", str(START), "stop"], capture_output=True, timeout=60)


def test_srun_launch_matches_popen(tmp_path: Path, slurm_conf: str) -> None:
    popen = tmp_path / "popen"
    run_script(
        [str(SCRIPTS / "ddp_run.py"), "--strategy", "ld_ddp", "--max-steps", "3", "--out", str(popen)],
        timeout=BUDGET,
    )
    out = tmp_path / "srun"
    cmd = ["srun", "-N", "1", "--ntasks-per-node", "2", "--export", "ALL", "--kill-on-bad-exit=1"]
    proc = run_command(
        [
            *cmd,
            "python",
            str(SCRIPTS / "ddp_run.py"),
            "--strategy",
            "ld_ddp",
            "--max-steps",
            "3",
            "--out",
            str(out),
        ],
        BUDGET,
        SLURM_CONF=slurm_conf,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "SLURM" in proc.stderr, "Lightning should have detected the SLURM environment"
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["hook_calls"] > 0
        assert_same_weights(w, load_rank(popen, 0)[0], atol=0)


def test_horovod_adasum_under_srun_pmix(tmp_path: Path, slurm_conf: str) -> None:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    out = tmp_path / "hvd"
    cmd = [
        "srun",
        "--mpi=pmix",
        "-N",
        "1",
        "--ntasks-per-node",
        "2",
        "--export",
        "ALL",
        "--kill-on-bad-exit=1",
    ]
    proc = run_command(
        [*cmd, "python", str(SCRIPTS / "hvd_train.py"), "--strategy", "horovod_adasum", "--max-steps", "6"]
        + ["--out", str(out)],
        BUDGET,
        SLURM_CONF=slurm_conf,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    w0, info0 = load_rank(out, 0)
    w1, info1 = load_rank(out, 1)
    assert info0["world_size"] == 2 and info0["stats"]["adasum.calls"] == 6
    assert_same_weights(w0, w1, atol=0)
