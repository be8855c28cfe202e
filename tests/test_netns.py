"""The emulated cluster (``lightning_dist.cluster.netns``): network namespaces joined by veth links, the tbf
cap, teardown on errors and after crashes, and trainings across 2 nodes whose final weights equal the
same run on one host (``DDP()``, ``Compressed("powersgd")``, ``HorovodAdasum()`` under mpirun, and
``Elastic()`` under two torchrun agents with a worker killed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import SCRIPTS, assert_same_weights, child_env, load_rank, run_command

from lightning_dist.cluster import netns
from lightning_dist.cluster.netns import ClusterUnavailable, EmulatedCluster

slow = pytest.mark.slow
needs_netns = pytest.mark.skipif(
    netns.unavailable_reason() is not None, reason=str(netns.unavailable_reason())
)
BUDGET = 120
"""Seconds for one 2-process training (about 10 s here): a test's two runs stay below its 300 s timeout."""
TRAIN = str(SCRIPTS / "netns_train.py")
HVD_TRAIN = str(SCRIPTS / "hvd_train.py")


def leftovers(prefix: str) -> list[str]:
    """Namespaces, root-namespace links and agent folders of the cluster ``prefix`` still present."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return (
        [ns for ns in netns.list_namespaces() if ns.startswith(f"{prefix}-")]
        + [line for line in links.splitlines() if prefix in line]
        + netns._agent_dirs(prefix)
    )


# --- no processes ---------------------------------------------------------------------------


def test_nodes_addresses_env_and_commands() -> None:
    cluster = EmulatedCluster(3, rate_mbit=100, subnet="10.88.0.0/24", prefix="ldt", master_port=1234)
    assert [n.address for n in cluster.nodes] == ["10.88.0.1", "10.88.0.2", "10.88.0.3"]
    assert cluster.namespaces == ["ldt-node0", "ldt-node1", "ldt-node2", "ldt-switch"]
    env = cluster.nodes[2].env(1234)
    assert env == {
        "GLOO_SOCKET_IFNAME": "veth2",
        "NCCL_SOCKET_IFNAME": "veth2",
        "MASTER_ADDR": "10.88.0.1",
        "MASTER_PORT": "1234",
        "NODE_RANK": "2",
    }
    assert cluster.env(2, base={"A": "1", "NODE_RANK": "9"}) == {"A": "1", **env}
    assert cluster.command(1, ["python", "x.py"]) == ["ip", "netns", "exec", "ldt-node1", "python", "x.py"]
    assert EmulatedCluster(2).namespaces[0] != EmulatedCluster(2).namespaces[0], "prefix unique per instance"
    assert EmulatedCluster(2).switch is None, "two nodes share one veth pair"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": 1}, "nodes=1 must be an integer >= 2"),
        ({"rate_mbit": 0}, "rate_mbit=0 must be a number > 0"),
        ({"subnet": "10.77.0.0/33"}, "subnet='10.77.0.0/33' must be an IPv4 network"),
        ({"nodes": 3, "subnet": "10.77.0.0/31"}, "fewer than nodes=3 host addresses"),
        ({"prefix": "a-b"}, "prefix='a-b' must be 1-32 letters"),
    ],
)
def test_bad_arguments_fail_early(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        EmulatedCluster(**kwargs)  # type: ignore[arg-type]


def test_not_up_is_refused() -> None:
    with pytest.raises(RuntimeError, match="is not up"):
        EmulatedCluster(2).mpirun_args()


def test_non_root_and_missing_iproute2_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="needs root"):
        EmulatedCluster(2).up()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    with pytest.raises(ClusterUnavailable, match=r"iproute2 \(tc not found\): apt-get install iproute2"):
        EmulatedCluster(2, rate_mbit=10).up()
    assert netns.unavailable_reason(rate_limited=False) is None, "without a cap tc is not needed"


# --- namespaces (root) ----------------------------------------------------------------------


@slow
@needs_netns
def test_two_nodes_reach_each_other_at_the_capped_rate() -> None:
    with EmulatedCluster(2, rate_mbit=100) as cluster:
        assert set(cluster.namespaces) <= set(netns.list_namespaces())
        there, back = cluster.measure_mbit(0, 1), cluster.measure_mbit(1, 0)
        rx, tx = cluster.link_bytes(1)
        assert rx > 16 << 20 and tx > 16 << 20, (rx, tx)
    print(f"100 Mbit/s cap: {there:.1f} Mbit/s node0->node1, {back:.1f} Mbit/s node1->node0")
    assert 50 < there < 110 and 50 < back < 110, (there, back)
    assert leftovers(cluster.prefix) == []
    with EmulatedCluster(2) as uncapped:
        free = uncapped.measure_mbit(0, 1, nbytes=64 << 20)
    assert free > 500, f"uncapped link only {free:.0f} Mbit/s: the cap test above would be blind"


@slow
@needs_netns
def test_three_nodes_over_the_bridge_all_reach_each_other() -> None:
    with EmulatedCluster(3, rate_mbit=200) as cluster:
        assert cluster.switch in netns.list_namespaces()
        rates = {(s, d): cluster.measure_mbit(s, d, nbytes=4 << 20) for s, d in [(0, 2), (2, 1), (1, 0)]}
    assert all(100 < r < 220 for r in rates.values()), rates
    assert leftovers(cluster.prefix) == []


@slow
@needs_netns
def test_teardown_after_an_exception_kills_every_process_in_the_namespaces() -> None:
    cluster = EmulatedCluster(2, rate_mbit=50)
    with pytest.raises(RuntimeError, match="boom"), cluster:
        tracked = cluster.popen(1, ["sleep", "600"])
        stray = subprocess.Popen(
            cluster.command(0, ["sleep", "600"]), start_new_session=True
        )  # not via popen
        raise RuntimeError("boom")
    assert tracked.poll() is not None
    assert stray.wait(timeout=10) == -9, "a process the cluster did not start is killed too"
    assert leftovers(cluster.prefix) == []
    cluster.down()  # idempotent


@slow
@needs_netns
def test_up_removes_the_remains_of_a_crashed_run(tmp_path: Path) -> None:
    prefix = f"ldcrash{os.getpid()}"
    crash = (
        "import os, subprocess, sys\n"
        "from lightning_dist.cluster.netns import EmulatedCluster\n"
        "named = EmulatedCluster(2, prefix=sys.argv[1]).up()\n"
        "auto = EmulatedCluster(2).up()\n"
        "named.popen(1, ['sleep', '600'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(auto.prefix, flush=True)\n"
        "os._exit(0)\n"
    )
    proc = run_command([sys.executable, "-c", crash, prefix], 60)
    assert proc.returncode == 0, proc.stderr
    auto_prefix = proc.stdout.split()[-1]
    assert leftovers(prefix) and leftovers(auto_prefix), "the crashed run left its cluster behind"
    with EmulatedCluster(2, prefix=prefix) as cluster:
        pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-node1"], capture_output=True, text=True)
        assert pids.stdout.strip() == "", "the stale node's processes were killed"
        assert leftovers(auto_prefix) == [], "a cluster whose process is gone is removed"
        assert cluster.measure_mbit(0, 1, nbytes=4 << 20) > 0
    assert leftovers(prefix) == []


# --- trainings across 2 nodes ---------------------------------------------------------------


STRATEGIES = ("DDP", "powersgd")


@pytest.fixture(scope="module")
def across_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EmulatedCluster]:
    """Each of ``STRATEGIES`` across 2 nodes at 1 Gbit/s, one after another in one process per node;
    each node records what its veth received during each fit."""
    if netns.unavailable_reason() is not None:
        pytest.skip(str(netns.unavailable_reason()))
    root = tmp_path_factory.mktemp("nodes")
    runs = [
        [TRAIN, "--strategy", s, "--devices", "1", "--num-nodes", "2", "--out", str(root / s)]
        for s in STRATEGIES
    ]
    argv = [sys.executable, str(SCRIPTS / "in_sequence.py"), json.dumps(runs)]
    with EmulatedCluster(2, rate_mbit=1000) as cluster:
        results = cluster.run_each(argv, timeout=BUDGET, env=child_env())
    for node, res in zip(cluster.nodes, results):
        assert res.returncode == 0, (
            f"node {node.rank} exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
        )
    return root, cluster


@slow
@needs_netns
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_across_two_nodes_equals_one_host(
    across_nodes: tuple[Path, EmulatedCluster], shared_popen: dict[str, Path], strategy: str
) -> None:
    """The same run on one host is tests/shared_runs.py's ``netns_<strategy>``."""
    ref, ref_info = load_rank(shared_popen[f"netns_{strategy}"], 0)
    root, cluster = across_nodes
    nodes = root / strategy
    received = load_rank(nodes, 1)[1]["veth_received"]
    params = sum(v.numel() for v in ref.values())
    assert received > params * 4, (
        f"node 1 received {received} B over the veth: the gradients did not cross it"
    )
    for rank, node in enumerate(cluster.nodes):
        w, info = load_rank(nodes, rank)
        assert info["world_size"] == 2 and info["node_rank"] == rank
        assert info["master_addr"] == cluster.nodes[0].address and info["gloo_ifname"] == node.ifname
        assert info["global_step"] == ref_info["global_step"] == 6
        assert_same_weights(w, ref, atol=0)  # bitwise: same ranks, same reduction order


@slow
@needs_netns
@pytest.mark.horovod
def test_horovod_adasum_with_mpirun_across_two_nodes_equals_one_host(
    tmp_path: Path, shared_mpirun: dict[str, Path]
) -> None:
    """The same run under mpirun on one host is tests/shared_runs.py's ``horovod_adasum_6``."""
    train = [sys.executable, HVD_TRAIN, "--strategy", "horovod_adasum", "--max-steps", "6"]
    forward = ["-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"]
    host = shared_mpirun["horovod_adasum_6"]
    nodes = tmp_path / "nodes"
    with EmulatedCluster(2, rate_mbit=1000) as cluster:
        before = cluster.link_bytes(1)
        proc = run_command(
            cluster.mpirun_command(2, [*forward, *train, "--out", str(nodes)]),
            BUDGET,
            **cluster.nodes[0].env(),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        received = cluster.link_bytes(1)[0] - before[0]
    ref, _ = load_rank(host, 0)
    assert received > sum(v.numel() for v in ref.values()) * 4, f"only {received} B crossed the veth"
    for rank in (0, 1):
        w, info = load_rank(nodes, rank)
        assert info["world_size"] == 2 and info["stats"]["adasum.calls"] == 6
        assert_same_weights(w, ref, atol=0)  # bitwise: same ranks, same reduction order


def elastic_agent_argv(cluster: EmulatedCluster, out: Path, *args: str) -> Any:
    """One torchrun agent per node on a c10d rendezvous hosted by node 0 (at its veth address)."""
    endpoint = f"{cluster.nodes[0].address}:29400"

    def argv(node: netns.Node) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                "--rdzv-id=netns", f"--rdzv-conf=is_host={int(node.rank == 0)}",
                f"--local-addr={node.address}",  # the shared hostname resolves to loopback
                str(SCRIPTS / "elastic_run.py"), "--out", str(out), "--commit-every", "3",
                "--max-steps", "12", *args]  # fmt: skip

    return argv


@slow
@needs_netns
def test_elastic_across_two_nodes_survives_a_kill_and_equals_one_host(
    tmp_path: Path, shared_torchrun: dict[str, Path]
) -> None:
    """Two torchrun agents in two namespaces: the worker of node 1 is SIGKILLed after step 7, both
    agents restart, the run resumes from the commit of step 6 and ends on the weights of the same
    run on one host (2 workers, no fault: tests/shared_runs.py's "average")."""
    host = shared_torchrun["average"]
    nodes = tmp_path / "nodes"
    env = child_env(PYTHONPATH=str(SCRIPTS), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with EmulatedCluster(2, rate_mbit=1000) as cluster:
        argv = elastic_agent_argv(cluster, nodes, "--kill-rank", "1", "--kill-step", "7")
        results = cluster.run_each(argv, timeout=BUDGET, env=env)
    for node, res in zip(cluster.nodes, results):
        assert res.returncode == 0, f"node {node.rank} exited {res.returncode}\n{res.stderr[-6000:]}"
    w, info = load_rank(nodes, 0)
    # (the restart is a failure on node 1's agent and a membership change on node 0's, so their
    # restart counts differ: what matters is the commit it resumed from)
    assert info["resumed_from"] == 6 and info["global_step"] == 12, info
    ref, _ = load_rank(host, 0)
    assert_same_weights(w, ref, atol=1e-6)
