"""Two real SLURM nodes on one machine (``lightning_dist.cluster.slurm_nodes``): ``slurmd -N n1`` and
``slurmd -N n2`` in two network namespaces joined by a veth link, slurmctld in n1's, and jobs across
them: one task per node, ``DDP()`` (devices=1, num_nodes=2) under srun and as an sbatch job from
``lightning-dist slurm``, and ``HorovodAdasum()`` under ``srun --mpi=pmix`` and as an sbatch job, each
with the final weights of the same run on one host, and with the gradients crossing the veth."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import SCRIPTS, assert_same_weights, load_rank, run_command
from test_slurm import DONE

from lightning_dist.cluster import slurm_nodes
from lightning_dist.cluster.slurm_nodes import SlurmNodes

pytestmark = pytest.mark.slow
START_BUDGET = 90
"""Seconds to bring the two nodes up (about 6 s here), inside the first test's 300 s timeout."""
BUDGET = 90
"""Seconds for one 2-process run (5-10 s here), at most half the 300 s test timeout."""
TRAIN = str(SCRIPTS / "netns_train.py")
HVD_TRAIN = str(SCRIPTS / "hvd_train.py")
HVD_ARGS = ["--strategy", "horovod_adasum", "--max-steps", "6"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmNodes]:
    reason = slurm_nodes.unavailable_reason()
    if reason:
        pytest.skip(reason)
    # a short state path (PMIx puts unix sockets under the spool folder) and a prefix of its own (`up()`
    # removes a stale cluster of the same prefix: not the one `start-two-node-slurm.sh` started)
    state = tempfile.mkdtemp(prefix="ldsn")
    nodes = SlurmNodes(2, state, prefix=f"ldslurmt{os.getpid()}")
    try:
        nodes.up(timeout=START_BUDGET)
    except slurm_nodes.ClusterUnavailable as err:
        pytest.skip(str(err))
    try:
        yield nodes
    finally:
        nodes.down()
        shutil.rmtree(state, ignore_errors=True)
        assert not [ns for ns in nodes.net.namespaces if ns in slurm_nodes.netns.list_namespaces()]


def on_n1(cluster: SlurmNodes, argv: list[str], timeout: float = BUDGET) -> subprocess.CompletedProcess[str]:
    """``argv`` on node n1 (clients have no route from the root namespace), with SLURM_CONF."""
    return run_command(cluster.command(argv), timeout, SLURM_CONF=cluster.conf)


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (
        f"{' '.join(proc.args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


SRUN = ["srun", "-N", "2", "--ntasks-per-node", "1", "--export", "ALL", "--kill-on-bad-exit=1"]


def test_srun_runs_one_task_in_each_node(cluster: SlurmNodes) -> None:
    report = (
        'echo "$SLURM_PROCID $SLURMD_NODENAME $(hostname) $(readlink /proc/self/ns/net) '
        '$(ip -o -4 addr show scope global | awk \'{print $2 "=" $4}\')"'
    )
    proc = ok(on_n1(cluster, [*SRUN, "sh", "-c", report]))
    rows = sorted(line.split() for line in proc.stdout.splitlines() if line.strip())
    assert len(rows) == 2, proc.stdout
    assert [r[:2] for r in rows] == [["0", "n1"], ["1", "n2"]], rows
    assert rows[0][2] == rows[1][2] == cluster.hostname, "same machine, same hostname"
    assert rows[0][3] != rows[1][3], f"both tasks in one network namespace: {rows}"
    n1, n2 = cluster.net.nodes
    assert rows[0][4:] == [f"{n1.ifname}={n1.address}/24"] and rows[1][4:] == [f"{n2.ifname}={n2.address}/24"]


def veth_received(cluster: SlurmNodes) -> int:
    return cluster.net.link_bytes(1)[0]


def assert_crossed(cluster: SlurmNodes, before: int, ref: dict) -> None:
    received = veth_received(cluster) - before
    params = sum(v.numel() for v in ref.values())
    assert received > params * 4, (
        f"node n2 received {received} B over the veth: the gradients did not cross it"
    )


@pytest.mark.parametrize("launch", ["srun", "sbatch"])
def test_ddp_across_two_slurm_nodes_equals_one_host(
    tmp_path: Path, cluster: SlurmNodes, shared_popen: dict[str, Path], launch: str
) -> None:
    """No MASTER_ADDR, MASTER_PORT or GLOO_SOCKET_IFNAME given: Lightning's SLURM environment takes n1
    (resolved by the node's /etc/hosts) and a port from the job id, Gloo the node's veth via the hostname.
    The same run on one host is tests/shared_runs.py's ``netns_DDP``."""
    ref, ref_info = load_rank(shared_popen["netns_DDP"], 0)
    out = tmp_path / "nodes"
    train = [
        sys.executable,
        TRAIN,
        "--strategy",
        "DDP",
        "--devices",
        "1",
        "--num-nodes",
        "2",
        "--out",
        str(out),
    ]
    before = veth_received(cluster)
    if launch == "srun":
        proc = ok(on_n1(cluster, [*SRUN, *train]))
        log = proc.stderr
    else:
        log = run_sbatch(cluster, tmp_path / "job", ["--nodes", "2", "--devices", "1", "--strategy", "DDP"], train,
                         "srun --ntasks-per-node=1")  # fmt: skip
    assert "SLURM auto-requeueing enabled" in log, "Lightning should run on its SLURMEnvironment"
    assert_crossed(cluster, before, ref)
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["node_rank"] == rank and info["master_addr"] == "n1", info
        assert info["global_step"] == ref_info["global_step"] == 6
        assert_same_weights(w, ref, atol=0)  # bitwise: same ranks, same reduction order


def run_sbatch(cluster: SlurmNodes, work: Path, options: list[str], command: list[str], expected: str) -> str:
    """Write the job with `lightning-dist slurm OPTIONS -- COMMAND`, submit it with `sbatch` on n1, wait
    until it has completed and return its output."""
    work.mkdir(parents=True)
    script, output = work / "job.sbatch", work / "slurm.out"
    cli = [
        "lightning-dist",
        "slurm",
        *options,
        "--job-name",
        f"ld-{work.parent.name}",
        "--script",
        str(script),
    ]
    ok(on_n1(cluster, [*cli, "--output", str(output), "--chdir", str(work), "--", *command], 60))
    assert expected in script.read_text(), script.read_text()
    job = ok(on_n1(cluster, ["sbatch", "--parsable", str(script)], 60)).stdout.strip().split(";")[0]
    try:
        fields = wait_done(cluster, job, time.monotonic() + BUDGET)
    finally:
        on_n1(cluster, ["scancel", job], 30)  # a no-op once it is done
    log = output.read_text() if output.exists() else "(no output)"
    assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", (
        f"{fields}\n{log[-6000:]}"
    )
    return log


def wait_done(cluster: SlurmNodes, job: str, deadline: float) -> dict[str, str]:
    """`scontrol show job` of ``job`` (JobState, ExitCode, ...) once it has finished, polled every
    0.5 s: `sbatch --wait` polls at 2, 8, then 32 s, which adds up to half a minute to a 10 s job."""
    while True:
        proc = on_n1(cluster, ["scontrol", "show", "job", "-o", job], 30)
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}
        if fields.get("JobState") in DONE:
            return fields
        assert time.monotonic() < deadline, f"job {job} not done in time: {fields or proc.stderr}"
        time.sleep(0.5)


def needs_horovod_pmix(cluster: SlurmNodes) -> None:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    plugins = on_n1(cluster, ["srun", "--mpi=list"], 30)
    if "pmix" not in plugins.stdout + plugins.stderr:
        pytest.skip(f"srun has no pmix plugin: {plugins.stdout.strip()} {plugins.stderr.strip()}")


@pytest.mark.horovod
@pytest.mark.parametrize("launch", ["srun", "sbatch"])
def test_horovod_adasum_across_two_slurm_nodes_equals_mpirun_on_one_host(
    tmp_path: Path, cluster: SlurmNodes, launch: str, request: pytest.FixtureRequest
) -> None:
    """The same run under mpirun on one host is tests/shared_runs.py's ``horovod_adasum_6``."""
    needs_horovod_pmix(cluster)
    ref, _ = load_rank(request.getfixturevalue("shared_mpirun")["horovod_adasum_6"], 0)
    out = tmp_path / "nodes"
    train = [sys.executable, HVD_TRAIN, *HVD_ARGS, "--out", str(out)]
    before = veth_received(cluster)
    if launch == "srun":
        ok(on_n1(cluster, ["srun", "--mpi=pmix", *SRUN[1:], *train]))
    else:
        run_sbatch(cluster, tmp_path / "job", ["--nodes", "2", "--strategy", "horovod_adasum"], train,
                   "srun --mpi=pmix")  # fmt: skip
    assert_crossed(cluster, before, ref)
    for rank in (0, 1):
        w, info = load_rank(out, rank)
        assert info["world_size"] == 2 and info["stats"]["adasum.calls"] == 6
        assert_same_weights(w, ref, atol=0)  # bitwise: same ranks, same reduction order
