"""A SLURM cluster of N real nodes on one machine: one ``slurmd -N nI`` per network namespace of an
``EmulatedCluster`` (veth links), ``slurmctld`` in the first. Root only; needs Debian's slurmctld,
slurmd, slurm-client and munge, and iproute2 + util-linux (``unshare``, ``nsenter``).

Each daemon runs in its node's network namespace and in a private mount namespace whose ``/etc/hosts``
maps the node names (``n1``, ``n2`` ...) to their veth addresses and this machine's hostname to the
node's own address, as on a real cluster: Lightning's SLURM environment resolves ``MASTER_ADDR`` from
``SLURM_NODELIST`` and Gloo finds the node's interface from its hostname, with no per-node variable.
(``ip netns exec`` is not used for the daemons: it remounts ``/sys``, and slurmd then fails with
"No filesystem mounted on /sys/fs/cgroup"; ``nsenter --net`` keeps the host's ``/sys``.)

Clients (``srun``, ``sbatch``, ``sinfo``) must run inside a node too (the root namespace has no route
to the veth subnet): ``cluster.command(argv)``, or the ``STATE/on-n1`` wrapper the cluster writes.

    with SlurmNodes(nodes=2) as cluster:
        subprocess.run(cluster.command(["srun", "-N2", "--ntasks-per-node=1", "hostname"]),
                       env=cluster.env())

    python -m lightning_dist.cluster.slurm_nodes up      # prints SLURM_CONF=...; leaves it running
    /tmp/ld_slurm_nodes/on-n1 srun -N2 --ntasks-per-node=1 printenv SLURMD_NODENAME
    python -m lightning_dist.cluster.slurm_nodes down

Its config, state, ports (6917/6918) and cluster name are its own, so it can run next to the one-node
cluster of ``scripts/start-local-slurm.sh``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Optional

from typing_extensions import Self, override

from lightning_dist.checks import check_int
from lightning_dist.cluster import netns
from lightning_dist.cluster.netns import ClusterUnavailable, EmulatedCluster, UpDown

DEFAULT_STATE = "/tmp/ld_slurm_nodes"
"""Not under ``/tmp/lightning_dist_slurm``: start-local-slurm.sh finds its daemons by that prefix."""
DEFAULT_PREFIX = "ldslurm"
DEFAULT_SUBNET = "10.78.0.0/24"
CTLD_PORT = 6917
SLURMD_PORT = 6918
CLUSTER_NAME = "ld_nodes"


def unavailable_reason() -> Optional[str]:
    """Why a ``SlurmNodes`` cannot be built here (``None``: it can); starts no process."""
    reason = netns.unavailable_reason(rate_limited=False)
    if reason:
        return reason
    missing = [
        t for t in ("slurmctld", "slurmd", "srun", "munged", "unshare", "nsenter") if not shutil.which(t)
    ]
    if missing:
        return f"SlurmNodes needs {', '.join(missing)}: apt-get install slurmctld slurmd slurm-client munge util-linux"
    return None


def _ensure_munge() -> None:
    """Start munged (with a key of its own if there is none) unless it runs already."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
        os.makedirs(d, exist_ok=True)
    key = "/etc/munge/munge.key"
    if not os.path.exists(key) or os.path.getsize(key) == 0:
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
    subprocess.run(["chown", "-R", "munge:munge", "/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"],
                   capture_output=True)  # fmt: skip
    os.chmod(key, 0o400)
    proc = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], capture_output=True, text=True)
    if proc.returncode != 0:
        proc = subprocess.run(["munged", "--force"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not start munged: {proc.stderr.strip()}")


class SlurmNodes(UpDown):
    """``nodes`` SLURM nodes ``n1`` ... ``nN`` (``cpus`` CPUs each), one per network namespace of an
    ``EmulatedCluster`` on ``subnet``; ``slurmctld`` runs in the first. Config, state and logs go to
    ``state_dir`` (``slurm.conf`` there is ``SLURM_CONF``); ``up()`` starts from an empty state."""

    def __init__(
        self,
        nodes: int = 2,
        state_dir: str = DEFAULT_STATE,
        prefix: str = DEFAULT_PREFIX,
        subnet: str = DEFAULT_SUBNET,
        *,
        cpus: int = 1,
        ctld_port: int = CTLD_PORT,
        slurmd_port: int = SLURMD_PORT,
        cluster_name: str = CLUSTER_NAME,
    ) -> None:
        check_int("cpus", cpus, 1)
        self.net = EmulatedCluster(nodes, subnet=subnet, prefix=prefix)
        self.state_dir, self.cpus = os.path.abspath(state_dir), cpus
        self.ctld_port, self.slurmd_port, self.cluster_name = ctld_port, slurmd_port, cluster_name
        self.hostname = socket.gethostname()
        self.names = [f"n{n.rank + 1}" for n in self.net.nodes]
        self.conf = os.path.join(self.state_dir, "slurm.conf")
        """``SLURM_CONF`` for clients."""
        self.is_up = False

    def __repr__(self) -> str:
        return f"SlurmNodes({len(self.names)} nodes on {self.net.subnet}, SLURM_CONF={self.conf})"

    # --- files -------------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.state_dir, *parts)

    def slurm_conf_text(self) -> str:
        first = self.net.nodes[0]
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.hostname}({first.address})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool', '%n')}",
            f"TmpFS={self._path('tmp', '%n')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd.%n.pid')}",
            f"SlurmctldLogFile={self._path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self._path('log', 'slurmd.%n.log')}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "ReturnToService=2",
        ]
        for name, node in zip(self.names, self.net.nodes):
            lines.append(
                f"NodeName={name} NodeAddr={node.address} NodeHostname={self.hostname} CPUs={self.cpus} "
                "State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=nodes Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=YES"
        )
        return "\n".join(lines) + "\n"

    def hosts_text(self, rank: int) -> str:
        """``/etc/hosts`` as seen on node ``rank``: the node names, this machine's hostname as the
        node's own address, then the machine's file without its lines for the hostname."""
        ours = [f"{n.address} {name}" for name, n in zip(self.names, self.net.nodes)]
        ours.insert(0, f"{self.net.nodes[rank].address} {self.hostname}")
        try:
            with open("/etc/hosts") as fh:
                rest = [
                    line.rstrip("\n") for line in fh if self.hostname not in line.split("#")[0].split()[1:]
                ]
        except OSError:
            rest = ["127.0.0.1 localhost"]
        return "\n".join(["# lightning_dist SlurmNodes", *ours, *rest]) + "\n"

    def _write_files(self) -> None:
        for sub in ("state", "log", "hosts"):
            shutil.rmtree(self._path(sub), ignore_errors=True)
        for name in self.names:
            for sub in ("spool", "tmp"):
                shutil.rmtree(self._path(sub, name), ignore_errors=True)
                os.makedirs(self._path(sub, name))
        for sub in ("state", "log", "hosts"):
            os.makedirs(self._path(sub))
        with open(self.conf, "w") as fh:
            fh.write(self.slurm_conf_text())
        for rank, name in enumerate(self.names):
            with open(self._path("hosts", name), "w") as fh:
                fh.write(self.hosts_text(rank))
            wrapper = self._path(f"on-{name}")
            with open(wrapper, "w") as fh:
                fh.write(
                    "#!/bin/sh\n"
                    f"# run a command on SLURM node {name} (its network namespace and /etc/hosts)\n"
                    f"export SLURM_CONF={shlex.quote(self.conf)}\n"
                    f'exec {shlex.join(self.command([], rank))} "$@"\n'
                )
            os.chmod(wrapper, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)

    # --- running things ----------------------------------------------------------------------

    def command(self, argv: Sequence[str], node: int = 0) -> list[str]:
        """``argv`` run on node ``node`` (default the first: where clients belong): in its network
        namespace, with its ``/etc/hosts``."""
        ns = self.net.nodes[node].namespace
        inner = f'mount --bind "$0" /etc/hosts && exec nsenter --net=/run/netns/{ns} "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", inner,
                self._path("hosts", self.names[node]), *map(str, argv)]  # fmt: skip

    def env(self, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with ``SLURM_CONF``."""
        return {**(os.environ if base is None else base), "SLURM_CONF": self.conf}

    def _start(self, argv: Sequence[str], node: int) -> None:
        proc = subprocess.run(self.command(argv, node), env=self.env(), capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(
                f"`{shlex.join(argv)}` on {self.names[node]} exited {proc.returncode}: "
                f"{(proc.stdout + proc.stderr).strip()}\n{self.logs()}"
            )

    def logs(self, tail: int = 2000) -> str:
        """The tails of slurmctld's and every slurmd's log."""
        out = []
        for name in ["slurmctld", *(f"slurmd.{n}" for n in self.names)]:
            path = self._path("log", f"{name}.log")
            with contextlib.suppress(OSError), open(path, errors="replace") as fh:
                out.append(f"--- {path} ---\n{fh.read()[-tail:]}")
        return "\n".join(out)

    def node_states(self) -> dict[str, str]:
        proc = subprocess.run(self.command(["sinfo", "-h", "-N", "-o", "%N %T"]), env=self.env(),
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        return dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)

    # --- lifecycle ---------------------------------------------------------------------------

    @override
    def up(self, timeout: float = 60) -> Self:
        """Create the namespaces, write the config, start munged (if needed), slurmctld and the
        slurmds, and wait until every node is idle; on failure everything is removed."""
        if self.is_up:
            return self
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self.net.up()
        self.is_up = True
        try:
            self._write_files()
            _ensure_munge()
            self._start(["slurmctld", "-f", self.conf], 0)
            for rank, name in enumerate(self.names):
                self._start(["slurmd", "-f", self.conf, "-N", name], rank)
            deadline = time.monotonic() + timeout
            while True:
                states = self.node_states()
                if len(states) == len(self.names) and all(
                    s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states.values()
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SLURM nodes not idle after {timeout}s: {states}\n{self.logs()}")
                time.sleep(0.5)
        except BaseException:
            self.down()
            raise
        return self

    @override
    def down(self) -> None:
        """Kill the daemons and every job step (all processes of the namespaces) and remove the
        namespaces; the state folder stays for its logs. Idempotent."""
        remove(self.net.prefix)
        self.net.is_up = False
        self.is_up = False


def remove(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Kill every process in the namespaces ``prefix-*`` (slurmctld, slurmds, their jobs) and remove
    them; returns the namespaces removed."""
    return netns.remove_cluster(prefix)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dist.cluster.slurm_nodes",
        description="A SLURM cluster of N nodes on this machine: one slurmd per network namespace (root).",
    )
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start it and leave it running; prints SLURM_CONF=...")
    up.add_argument("--nodes", type=int, default=2, help="number of nodes n1..nN (default 2)")
    up.add_argument("--cpus", type=int, default=1, help="CPUs per node (default 1)")
    up.add_argument("--timeout", type=float, default=60, help="seconds to wait for the nodes")
    for p in (up, sub.add_parser("down", help="stop it: kill its daemons and jobs, remove the namespaces")):
        p.add_argument("--state-dir", default=DEFAULT_STATE, help=f"default {DEFAULT_STATE}")
        p.add_argument(
            "--prefix", default=DEFAULT_PREFIX, help=f"namespace prefix (default {DEFAULT_PREFIX})"
        )
    a = parser.parse_args(argv)
    if a.action == "down":
        print("\n".join(remove(a.prefix)) or f"no namespace with prefix {a.prefix}")
        return 0
    cluster = SlurmNodes(a.nodes, a.state_dir, a.prefix, cpus=a.cpus).up(timeout=a.timeout)
    print(
        f"clients run on n1: {cluster.state_dir}/on-n1 srun -N{a.nodes} --ntasks-per-node=1 hostname",
        file=sys.stderr,
    )
    print(
        f"stop with: python -m lightning_dist.cluster.slurm_nodes down --prefix {a.prefix}", file=sys.stderr
    )
    print(f"SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
