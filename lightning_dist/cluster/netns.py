"""An emulated multi-node cluster on one machine: N network namespaces ("nodes") joined by veth links,
optionally capped with ``tc tbf`` (``netem`` is not available everywhere), Gloo pinned to each node's
veth, and an mpirun agent that starts ranks inside the namespaces. Root only; needs iproute2.

Two nodes share one veth pair; three or more hang off a bridge in a namespace of its own. Nothing is
created in the root namespace, and everything is torn down on leaving the ``with`` block, on errors
included; ``up()`` first removes a stale cluster with the same prefix (a crashed run) and any
cluster with an automatic prefix whose process is gone.

    with EmulatedCluster(nodes=2, rate_mbit=100) as cluster:
        cluster.run_each([sys.executable, "train.py"], timeout=300)    # NODE_RANK, MASTER_ADDR ... set
        cluster.popen(0, ["mpirun", "-np", "2", *cluster.mpirun_args(), sys.executable, "hvd_train.py"])

    python -m lightning_dist.cluster.netns run --nodes 2 --rate-mbit 100 -- python train.py
    python -m lightning_dist.cluster.netns run --mpirun 2 -- python hvd_train.py
    python -m lightning_dist.cluster.netns up --prefix demo --rate-mbit 1000   # then: down --prefix demo
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Optional, Union

from typing_extensions import Self, override

from lightning_dist.checks import check_int, check_number

DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_MASTER_PORT = 29500
"""Each node has its own network stack, so a fixed port never collides with the host's."""
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_AUTO_PREFIX_RE = re.compile(r"^ld(\d+)x\d+-")
_counter = itertools.count()


class ClusterUnavailable(RuntimeError):
    """This machine cannot host an emulated cluster (not root, no iproute2, no network namespaces)."""


def unavailable_reason(rate_limited: bool = True) -> Optional[str]:
    """Why an ``EmulatedCluster`` cannot be built here (``None``: it can); cheap, starts no process."""
    if not sys.platform.startswith("linux"):
        return "EmulatedCluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "EmulatedCluster needs root: it creates network namespaces and veth links (run as root)"
    missing = [tool for tool in ("ip", "tc") if (tool == "ip" or rate_limited) and shutil.which(tool) is None]
    if missing:
        return f"EmulatedCluster needs iproute2 ({' and '.join(missing)} not found): apt-get install iproute2"
    return None


@dataclass(frozen=True)
class Node:
    """One emulated node: a network namespace with one veth interface."""

    rank: int
    """The node rank (``NODE_RANK``)."""
    namespace: str
    """The network namespace (``ip netns exec NAMESPACE ...``)."""
    ifname: str
    """This node's veth interface (``GLOO_SOCKET_IFNAME``)."""
    address: str
    """This node's IPv4 address on the cluster subnet."""
    master_addr: str
    """Node 0's address (``MASTER_ADDR``)."""

    def env(self, master_port: int = DEFAULT_MASTER_PORT) -> dict[str, str]:
        """What a process on this node needs to join a job whose rendezvous is on node 0."""
        return {
            "GLOO_SOCKET_IFNAME": self.ifname,
            "NCCL_SOCKET_IFNAME": self.ifname,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            "NODE_RANK": str(self.rank),
        }


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    """Names of the network namespaces that ``ip netns`` knows."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        proc = _ip("netns", "pids", namespace, check=False)
        pids = [int(p) for p in proc.stdout.split() if p.isdigit()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    proc = _ip("netns", "del", namespace, check=False)
    if proc.returncode != 0 and namespace in list_namespaces():
        raise RuntimeError(f"could not delete network namespace {namespace}: {proc.stderr.strip()}")


def _agent_dirs(prefix: str) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"lightning-dist-netns-{prefix}.*"))


def remove_cluster(prefix: str) -> list[str]:
    """Remove every namespace (killing its processes) and agent folder of the cluster ``prefix``;
    returns the namespaces removed."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix={prefix!r} must be 1-32 letters, digits or underscores")
    removed = [ns for ns in list_namespaces() if ns.startswith(f"{prefix}-")]
    for ns in removed:
        _delete_namespace(ns)
    for folder in _agent_dirs(prefix):
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def remove_orphans() -> list[str]:
    """Remove clusters with an automatic prefix (``ld<pid>x<n>``) whose process is gone."""
    removed: list[str] = []
    for ns in list_namespaces():
        match = _AUTO_PREFIX_RE.match(ns)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            removed += remove_cluster(ns.split("-", 1)[0])
    return removed


def _pipe_text(stream: Optional[IO[bytes]]) -> str:
    if stream is None:
        return ""
    stream.seek(0)
    return stream.read().decode(errors="replace")


_RECEIVER = r"""
import socket, sys, time
nbytes, skip = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[3])))
srv.listen(1)
srv.settimeout(float(sys.argv[4]))
conn, _ = srv.accept()
got, start = 0, None
while got < nbytes:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    got += len(chunk)
    if start is None and got >= skip:
        start, mark = time.perf_counter(), got
end = time.perf_counter()
print((got - mark) * 8 / (end - start) / 1e6 if got == nbytes and end > start else -1)
"""

_SENDER = r"""
import socket, sys, time
host, port, nbytes, deadline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), time.monotonic() + float(sys.argv[4])
while True:
    try:
        conn = socket.create_connection((host, port), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
conn.settimeout(None)
conn.sendall(bytes(nbytes))
conn.close()
"""


class UpDown:
    """``with thing:`` is ``thing.up()`` ... ``thing.down()``, the latter on errors too."""

    def up(self) -> Self:
        raise NotImplementedError

    def down(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.down()


class EmulatedCluster(UpDown):
    """``nodes`` network namespaces joined by veth links, each link optionally capped at
    ``rate_mbit`` Mbit/s in each direction (``tc tbf``, ``burst``/``latency`` as given).

    Args:
        nodes: number of nodes (namespaces ``<prefix>-node0`` ...), at least 2.
        rate_mbit: the cap per node and direction in Mbit/s; ``None`` for none.
        subnet: the IPv4 subnet of the cluster; node ``i`` gets its ``i+1``-th host address.
        prefix: names the namespaces; default ``ld<pid>x<n>``, unique per instance.
        master_port: ``MASTER_PORT`` in ``Node.env``.
    """

    def __init__(
        self,
        nodes: int = 2,
        rate_mbit: Optional[float] = None,
        subnet: str = DEFAULT_SUBNET,
        prefix: Optional[str] = None,
        *,
        master_port: int = DEFAULT_MASTER_PORT,
        burst: str = "512kb",
        latency: str = "100ms",
    ) -> None:
        check_int("nodes", nodes, 2)
        if rate_mbit is not None:
            check_number("rate_mbit", rate_mbit, 0, low_open=True)
        check_int("master_port", master_port, 1, 65535)
        try:
            network = ipaddress.IPv4Network(subnet)
        except ValueError as err:
            raise ValueError(
                f"subnet={subnet!r} must be an IPv4 network like '10.77.0.0/24': {err}"
            ) from None
        hosts = list(itertools.islice(network.hosts(), nodes))
        if len(hosts) < nodes:
            raise ValueError(f"subnet={subnet!r} has fewer than nodes={nodes} host addresses")
        prefix = prefix if prefix is not None else f"ld{os.getpid()}x{next(_counter)}"
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix={prefix!r} must be 1-32 letters, digits or underscores")
        self.prefix, self.rate_mbit, self.subnet = prefix, rate_mbit, str(network)
        self.master_port, self.burst, self.latency = master_port, burst, latency
        self.nodes = [
            Node(i, f"{prefix}-node{i}", f"veth{i}", str(hosts[i]), str(hosts[0])) for i in range(nodes)
        ]
        self.switch: Optional[str] = f"{prefix}-switch" if nodes > 2 else None
        """The namespace holding the bridge (three or more nodes)."""
        self.agent: Optional[str] = None
        """The mpirun ``plm_rsh_agent`` script (written by ``up()``)."""
        self._agent_dir: Optional[str] = None
        self._procs: list[subprocess.Popen[Any]] = []
        self.is_up = False

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster, the bridge's included."""
        return [n.namespace for n in self.nodes] + ([self.switch] if self.switch else [])

    def __repr__(self) -> str:
        rate = f"{self.rate_mbit} Mbit/s" if self.rate_mbit else "uncapped"
        return (
            f"EmulatedCluster(nodes={len(self.nodes)}, {rate}, subnet={self.subnet}, prefix={self.prefix!r})"
        )

    # --- lifecycle ---------------------------------------------------------------------------

    @override
    def up(self) -> Self:
        """Create the namespaces, links, addresses, caps and the mpirun agent; on any failure
        everything created so far is removed before the error propagates."""
        if self.is_up:
            return self
        reason = unavailable_reason(rate_limited=self.rate_mbit is not None)
        if reason:
            raise ClusterUnavailable(reason)
        remove_orphans()
        remove_cluster(self.prefix)
        self.is_up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        prefix_len = ipaddress.IPv4Network(self.subnet).prefixlen
        for ns in self.namespaces:
            try:
                _ip("netns", "add", ns)
            except RuntimeError as err:
                raise ClusterUnavailable(f"cannot create network namespaces here: {err}") from None
            _ip("-n", ns, "link", "set", "lo", "up")
        a, b = self.nodes[0], self.nodes[1]
        links: list[tuple[str, str]] = []  # (namespace, interface) of every veth end
        if self.switch is None:
            _ip("-n", a.namespace, "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname,
                "netns", b.namespace)  # fmt: skip
            links += [(a.namespace, a.ifname), (b.namespace, b.ifname)]
        else:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for node in self.nodes:
                port = f"port{node.rank}"
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", node.ifname,
                    "netns", node.namespace)  # fmt: skip
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                links += [(node.namespace, node.ifname), (self.switch, port)]
        for node in self.nodes:
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/{prefix_len}", "dev", node.ifname)
            _ip("-n", node.namespace, "link", "set", node.ifname, "up")
        if self.rate_mbit is not None:
            rate = f"{max(1, round(self.rate_mbit * 1000))}kbit"
            for ns, ifname in links:
                cmd = ["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", "tbf", "rate", rate,
                       "burst", self.burst, "latency", self.latency]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise ClusterUnavailable(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
        self._write_agent()

    def _write_agent(self) -> None:
        self._agent_dir = tempfile.mkdtemp(prefix=f"lightning-dist-netns-{self.prefix}.")
        cases = "\n".join(
            f"  {n.address}|{n.namespace}) ns={n.namespace}; ifname={n.ifname}; rank={n.rank} ;;"
            for n in self.nodes
        )
        script = (
            "#!/bin/sh\n"
            "# mpirun's plm_rsh_agent: run the command line mpirun hands over inside the host's namespace\n"
            'host=$1; shift\ncase "$host" in\n'
            f"{cases}\n"
            '  *) echo "netns agent: unknown host $host" >&2; exit 1 ;;\nesac\n'
            'exec ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$ifname" NCCL_SOCKET_IFNAME="$ifname" '
            'NODE_RANK="$rank" /bin/sh -c "$*"\n'
        )
        self.agent = os.path.join(self._agent_dir, "agent.sh")
        with open(self.agent, "w") as fh:
            fh.write(script)
        os.chmod(self.agent, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)

    @override
    def down(self) -> None:
        """Kill every process of the cluster and remove its namespaces and agent; idempotent."""
        errors: list[str] = []
        for proc in self._procs:
            _kill(proc)
        self._procs.clear()
        if self.is_up:
            existing = set(list_namespaces())
            for ns in self.namespaces:
                if ns in existing:
                    try:
                        _delete_namespace(ns)
                    except RuntimeError as err:
                        errors.append(str(err))
        if self._agent_dir is not None:
            shutil.rmtree(self._agent_dir, ignore_errors=True)
            self._agent_dir = self.agent = None
        self.is_up = False
        if errors:
            raise RuntimeError(
                f"{self!r}.down() left namespaces behind: {'; '.join(errors)}; remove them (as root) with "
                f"`python -m lightning_dist.cluster.netns down --prefix {self.prefix}`"
            )

    # --- running things ----------------------------------------------------------------------

    def node(self, node: Union[Node, int]) -> Node:
        return self.nodes[node] if isinstance(node, int) else node

    def command(self, node: Union[Node, int], argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node(node).namespace, *map(str, argv)]

    def env(self, node: Union[Node, int], base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``node``'s variables over it."""
        return {**(os.environ if base is None else base), **self.node(node).env(self.master_port)}

    def popen(
        self,
        node: Union[Node, int],
        argv: Sequence[str],
        env: Optional[Mapping[str, str]] = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` of ``argv`` in ``node``'s namespace, in a session of its own, with
        ``env`` (default: this process's) plus ``node.env()``; killed by ``down()`` if still running."""
        self._require_up()
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(node, argv), env=self.env(node, env), **kwargs)
        self._procs.append(proc)
        return proc

    def run_each(
        self,
        argv: Union[Sequence[str], Callable[[Node], Sequence[str]]],
        timeout: float,
        env: Optional[Mapping[str, str]] = None,
        *,
        grace: float = 15.0,
    ) -> list[subprocess.CompletedProcess[str]]:
        """Run one process per node (``argv``, or ``argv(node)``) and wait for all, each with stdout
        and stderr captured. Once one fails the others get ``grace`` seconds before they are killed
        (a rank waiting on a dead peer would otherwise hang); past ``timeout`` all are killed and
        ``TimeoutError`` carries their output."""
        argvs = [list(argv(n)) if callable(argv) else list(argv) for n in self.nodes]
        procs: list[subprocess.Popen[Any]] = []
        with contextlib.ExitStack() as stack:
            outs = [
                (stack.enter_context(tempfile.TemporaryFile()), stack.enter_context(tempfile.TemporaryFile()))
                for _ in self.nodes
            ]

            def kill_all() -> None:
                for p in procs:
                    _kill(p)

            stack.callback(kill_all)
            for node, node_argv, (out, err) in zip(self.nodes, argvs, outs):
                procs.append(self.popen(node, node_argv, env, stdout=out, stderr=err))
            deadline, failed_at = time.monotonic() + timeout, None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline:
                    kill_all()
                    tails = "\n".join(
                        f"--- node {i} ---\n{_pipe_text(o)[-2000:]}\n{_pipe_text(e)[-4000:]}"
                        for i, (o, e) in enumerate(outs)
                    )
                    raise TimeoutError(f"{shlex.join(argvs[0])} killed after {timeout}s\n{tails}")
                if failed_at is not None and now > failed_at + grace:
                    kill_all()
                time.sleep(0.05)
            results = [
                subprocess.CompletedProcess(p.args, p.returncode, _pipe_text(o), _pipe_text(e))
                for p, (o, e) in zip(procs, outs)
            ]
        return results

    def mpirun_args(self, slots: int = 1) -> list[str]:
        """mpirun flags that start ranks across the nodes (``slots`` per node); mpirun itself must
        run inside node 0 (``mpirun_command``). Ranks on other nodes get their node's GLOO_SOCKET_IFNAME and
        NODE_RANK from the agent: do not pass those with ``-x``."""
        self._require_up()
        check_int("slots", slots, 1)
        assert self.agent is not None
        args = [
            "--host", ",".join(f"{n.address}:{slots}" for n in self.nodes),
            "--bind-to", "none",
            "--mca", "plm_rsh_agent", self.agent,
            "--mca", "oob_tcp_if_include", self.subnet,
            "--mca", "btl_tcp_if_include", self.subnet,
        ]  # fmt: skip
        if os.geteuid() == 0:
            args.append("--allow-run-as-root")
        return args

    def mpirun_command(
        self, np: int, argv: Sequence[str], slots: int = 1, mpirun: str = "mpirun"
    ) -> list[str]:
        """``mpirun -np NP <mpirun_args> argv`` wrapped to run inside node 0 (run it with ``env(0)``;
        ``popen(0, ...)`` wraps by itself: give it the bare mpirun command)."""
        check_int("np", np, 1, len(self.nodes) * slots)
        return self.command(0, [mpirun, "-np", str(np), *self.mpirun_args(slots), *map(str, argv)])

    def link_bytes(self, node: Union[Node, int]) -> tuple[int, int]:
        """(received, sent) bytes so far on ``node``'s veth, headers included."""
        self._require_up()
        n = self.node(node)
        stats = json.loads(_ip("-n", n.namespace, "-j", "-s", "link", "show", "dev", n.ifname).stdout)[0][
            "stats64"
        ]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def measure_mbit(self, src: int = 0, dst: int = 1, nbytes: int = 16 << 20, timeout: float = 120) -> float:
        """TCP throughput in Mbit/s from node ``src`` to node ``dst`` (``nbytes`` of payload; the
        first 1 MiB, which the tbf burst lets through at full speed, is not timed)."""
        check_int("nbytes", nbytes, 2 << 20)
        port = 29400
        recv = self.popen(
            dst, [sys.executable, "-c", _RECEIVER, str(nbytes), str(1 << 20), str(port), str(timeout)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        send = self.popen(
            src, [sys.executable, "-c", _SENDER, self.nodes[dst].address, str(port), str(nbytes), str(timeout)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            out, err = recv.communicate(timeout=timeout)
            _, send_err = send.communicate(timeout=timeout)
        finally:
            _kill(recv)
            _kill(send)
        if recv.returncode != 0 or send.returncode != 0:
            raise RuntimeError(
                f"throughput probe failed: receiver {err.strip()!r}, sender {send_err.strip()!r}"
            )
        return float(out.strip())

    def _require_up(self) -> None:
        if not self.is_up:
            raise RuntimeError(f"{self!r} is not up: use `with cluster:` or call cluster.up() first")


def _own_group(proc: subprocess.Popen[Any]) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _kill(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if _own_group(proc):
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dist.cluster.netns",
        description="Emulated multi-node cluster: network namespaces joined by veth links (root, iproute2).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    for name, text in (
        ("up", "create a cluster and leave it up (remove it with `down --prefix`)"),
        ("run", "create a cluster, run a command on every node (or mpirun across them), tear it down"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--nodes", type=int, default=2, help="number of nodes (default 2)")
        p.add_argument("--rate-mbit", type=float, default=None, help="tbf cap per node and direction")
        p.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"IPv4 subnet (default {DEFAULT_SUBNET})")
        p.add_argument(
            "--prefix",
            default=None,
            required=name == "up",
            help="namespace name prefix (letters, digits, _)" + ("" if name == "up" else "; default: unique"),
        )
        p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, help="MASTER_PORT")
    run_parser = sub.choices["run"]
    run_parser.add_argument(
        "--mpirun", type=int, default=None, metavar="NP", help="mpirun -np NP across the nodes"
    )
    run_parser.add_argument("--slots", type=int, default=1, help="mpirun slots per node (default 1)")
    run_parser.add_argument("--timeout", type=float, default=3600, help="seconds before everything is killed")
    run_parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    down = sub.add_parser("down", help="remove the cluster PREFIX", description="remove the cluster PREFIX")
    down.add_argument("--prefix", required=True)
    a = parser.parse_args(argv)
    if a.action == "down":
        print("\n".join(remove_cluster(a.prefix)) or f"no namespace with prefix {a.prefix}")
        return 0
    cluster = EmulatedCluster(a.nodes, a.rate_mbit, a.subnet, a.prefix, master_port=a.master_port)
    if a.action == "up":
        cluster.up()
        for node in cluster.nodes:
            env = " ".join(f"{k}={v}" for k, v in node.env(cluster.master_port).items())
            print(f"node{node.rank}: ip netns exec {node.namespace}  ({env})")
        print("mpirun (inside node0):", shlex.join(cluster.mpirun_args()))
        print(f"remove with: python -m lightning_dist.cluster.netns down --prefix {cluster.prefix}")
        return 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        parser.error("run needs a command after --")
    with cluster:
        if a.mpirun is not None:
            mpirun = ["mpirun", "-np", str(a.mpirun), *cluster.mpirun_args(a.slots), *cmd]
            proc = cluster.popen(0, mpirun)
            try:
                return proc.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                print(f"killed after {a.timeout}s", file=sys.stderr)
                return 124
        try:
            results = cluster.run_each(cmd, a.timeout)
        except TimeoutError as err:
            print(err, file=sys.stderr)
            return 124
        for node, res in zip(cluster.nodes, results):
            for stream, text in ((sys.stdout, res.stdout), (sys.stderr, res.stderr)):
                for line in text.splitlines():
                    print(f"[node{node.rank}] {line}", file=stream)
        return max(abs(r.returncode) for r in results)


if __name__ == "__main__":
    sys.exit(main())
