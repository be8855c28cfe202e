"""Launch a ``FaultTolerant`` job on one machine: torchft's Lighthouse, then one torchrun per replica group.

    python -m lightning_dist.launch.fault_tolerant --groups 2 --max-restarts 3 -- train.py --epochs 1
    python -m lightning_dist.launch.fault_tolerant --groups 2 --nproc-per-group 4 -- train.py  # 4 per group

Each group is ``torchrun --standalone --nproc-per-node=G --max-restarts=R`` (``--nproc-per-group``,
default 1) with ``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` set: a group one of whose workers
dies is restarted (all its G workers) by its own torchrun and rejoins the others, which keep training. The Lighthouse listens on ``--bind`` (default
``127.0.0.1:0``, this machine only; ``--lighthouse URL`` uses a running one, and ``--group G``
starts only group G: one node of a cluster). Each torchrun runs under a standby (``warm_start.py``) that
has torch, Lightning and torchft imported and forks each worker torchrun (re)starts, so a restart
skips the imports (``--cold``: none). On SLURM run the Lighthouse once (``torchft_lighthouse --bind
<head>:29510 --min_replicas 1``) and on every node ``python -m lightning_dist.launch.fault_tolerant
--group $SLURM_NODEID --lighthouse http://<head>:29510 --host <node address> -- train.py``
(docs/live-recovery.md). torchft's INFO logs (every quorum, from the Lighthouse and each group) are
off unless ``--verbose`` (or ``LD_FT_VERBOSE=1``): warnings and errors only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Optional, Union

from lightning_dist.checks import check_int
from lightning_dist.collectives.fault_tolerant import (
    HOST_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_GROUP_ENV,
    require_torchft,
)
from lightning_dist.collectives.fault_tolerant_logs import (
    VERBOSE_ENV,
    configure_torchft_logs,
    quiet_servers,
    verbose_wanted,
)
from lightning_dist.collectives.fault_tolerant_timeouts import HEARTBEAT_TIMEOUT_MS
from lightning_dist.launch.warm_start import WORKER

MONITOR_INTERVAL_S = 0.05
"""How often each torchrun checks its worker (torchrun's default is 0.1 s): half of a restart's notice."""


class Lighthouse:
    """torchft's Lighthouse server in this process, listening on ``bind`` (``host:port``; port 0
    picks one). ``restart()`` stops it and starts a new one on the same address (its quorum state
    is lost; the groups' Managers retry and form the next quorum with it). ``heartbeat_timeout_ms``:
    a group whose heartbeats stopped this long ago is out of the next quorum (a dead group's peers
    wait this long, not a collective's timeout). ``verbose`` (default
    ``$LD_FT_VERBOSE``): its INFO logs, when torchft is not imported yet in this process."""

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        min_replicas: int = 1,
        join_timeout_ms: int = 1000,
        heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
        quorum_tick_ms: int = 50,
        verbose: Optional[bool] = None,
    ) -> None:
        configure_torchft_logs(verbose_wanted(verbose))
        check_int("min_replicas", min_replicas, 1, owner="Lighthouse")
        check_int("join_timeout_ms", join_timeout_ms, 0, owner="Lighthouse")
        check_int("heartbeat_timeout_ms", heartbeat_timeout_ms, 1, owner="Lighthouse")
        if ":" not in bind:
            raise ValueError(f"Lighthouse: bind={bind!r}; accepted: 'host:port' (port 0 picks a free one)")
        self._options = {
            "min_replicas": min_replicas,
            "join_timeout_ms": join_timeout_ms,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "quorum_tick_ms": quorum_tick_ms,
        }
        self._server: Any = self._start(bind)
        host = bind.rsplit(":", 1)[0]
        port = self._server.address().rsplit(":", 1)[1]
        self.bind = f"{host}:{port}"
        """The address it listens on, with the port it got (``restart`` reuses it)."""
        self.address: str = f"http://{self.bind}"
        """``http://host:port`` (what ``TORCHFT_LIGHTHOUSE`` holds): the listen address, not the
        machine's name (torchft's ``address()``), which may resolve to another interface."""

    def _start(self, bind: str) -> Any:
        require_torchft("Lighthouse")
        from torchft.coordination import LighthouseServer

        return LighthouseServer(bind=bind, **self._options)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def restart(self) -> None:
        self.shutdown()
        self._server = self._start(self.bind)

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def group_command(
    script: Sequence[str],
    *,
    max_restarts: int = 3,
    torchrun: Optional[str] = None,
    warm: bool = False,
    nproc_per_group: int = 1,
) -> list[str]:
    """The torchrun command of one replica group of ``nproc_per_group`` processes running ``script``
    (``[path, *args]``); ``warm``: under a standby that has torch, Lightning and torchft imported and
    forks each (re)started worker (``warm_start.py``), torchrun's entrypoint being its stand-in
    ``warm_worker.py``."""
    check_int("max_restarts", max_restarts, 0)
    check_int("nproc_per_group", nproc_per_group, 1)
    runner = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command = [
        *runner,
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc_per_group}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        *([str(WORKER)] if warm else []),
        *script,
    ]
    if not warm:
        return command
    standby = [sys.executable, "-m", "lightning_dist.launch.warm_start"]
    return [*standby, *(["--script", script[0]] if script and script[0] != "-m" else []), "--", *command]


def group_env(
    group: int, lighthouse: str, host: str = "127.0.0.1", env: Optional[dict[str, str]] = None
) -> dict[str, str]:
    """The environment of replica group ``group``: its id, the Lighthouse and the listen address;
    torchft's servers quiet (``RUST_LOG``) unless ``$LD_FT_VERBOSE`` says otherwise."""
    out = dict(os.environ if env is None else env)
    out.update({REPLICA_GROUP_ENV: str(group), LIGHTHOUSE_ENV: lighthouse, HOST_ENV: host})
    quiet_servers(out, verbose_wanted(env=out))
    return out


def start_groups(
    script: Sequence[str],
    groups: Union[int, Sequence[int]],
    lighthouse: str,
    *,
    max_restarts: int = 3,
    host: str = "127.0.0.1",
    env: Optional[dict[str, str]] = None,
    warm: bool = True,
    nproc_per_group: int = 1,
    **popen: Any,
) -> list[subprocess.Popen[Any]]:
    """Start ``groups`` torchruns (replica groups 0..groups-1, or the ids ``groups`` lists) of
    ``nproc_per_group`` processes of ``script``; the caller waits for them and ends them (by PID) if it stops early. ``warm`` (default): each under its standby
    (``group_command``), so a restarted worker skips the imports; a restart then takes torchrun's
    notice, a fork, the Trainer's setup and the heal."""
    if isinstance(groups, int):
        check_int("groups", groups, 1)
    ids = range(groups) if isinstance(groups, int) else groups
    return [
        subprocess.Popen(
            group_command(script, max_restarts=max_restarts, warm=warm, nproc_per_group=nproc_per_group),
            env=group_env(g, lighthouse, host, env),
            start_new_session=True,
            **popen,
        )
        for g in ids
    ]


def stop_groups(procs: Sequence[subprocess.Popen[Any]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the torchrun's own session: it and its workers
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def address_towards(url: str) -> str:
    """This machine's address on the interface that routes to ``url`` (``http://host:port``): what
    a replica group on a cluster node listens on and advertises (no packet is sent)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.hostname is None:
        raise ValueError(f"--lighthouse={url!r}; accepted: http://host:port")
    family, _, _, _, target = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dist.launch.fault_tolerant", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--groups", type=int, default=2, help="replica groups (one torchrun each)")
    parser.add_argument(
        "--group", type=int, default=None, help="start only this replica group (one node of a cluster)"
    )
    parser.add_argument(
        "--lighthouse", default=None, help="use the Lighthouse at http://host:port instead of starting one"
    )
    parser.add_argument(
        "--host",
        default=None,
        help="the groups' listen address (default: --bind's host; 'auto': this machine's address "
        "towards --lighthouse)",
    )
    parser.add_argument(
        "--nproc-per-group",
        type=int,
        default=1,
        help="processes of each replica group (torchrun --nproc-per-node; a node's devices)",
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts of each group by its torchrun")
    parser.add_argument("--min-replicas", type=int, default=1, help="the Lighthouse's quorum minimum")
    parser.add_argument("--bind", default="127.0.0.1:0", help="the Lighthouse's listen address")
    parser.add_argument("--join-timeout-ms", type=int, default=1000)
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=HEARTBEAT_TIMEOUT_MS,
        help="the Lighthouse drops a group whose heartbeats stopped this long ago: how soon the others "
        f"go on without a dead group (default {HEARTBEAT_TIMEOUT_MS}; torchft's: 5000)",
    )
    parser.add_argument(
        "--cold", action="store_true", help="no standby: torchrun starts each worker in a fresh Python"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"torchft's INFO logs, every quorum (default: warnings and errors; also ${VERBOSE_ENV}=1)",
    )
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- train.py [args]")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the training script after --")
    if args.nproc_per_group < 1:
        parser.error(f"--nproc-per-group={args.nproc_per_group}; accepted: 1 or more")
    if args.group is not None and args.lighthouse is None:
        parser.error("--group needs --lighthouse (the job's Lighthouse, started once elsewhere)")
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # the Lighthouse here and every group
    host = args.host or args.bind.rsplit(":", 1)[0]
    if host == "auto":
        if args.lighthouse is None:
            parser.error("--host auto needs --lighthouse (the address is the one that reaches it)")
        host = address_towards(args.lighthouse)
    # SIGTERM ends the replica groups too (they run in sessions of their own): raise, run the finally
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with contextlib.ExitStack() as stack:
        address = args.lighthouse
        if address is None:
            lighthouse = stack.enter_context(
                Lighthouse(
                    args.bind,
                    args.min_replicas,
                    join_timeout_ms=args.join_timeout_ms,
                    heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                )
            )
            address = lighthouse.address
            print(f"lighthouse: {address}", flush=True)
        procs = start_groups(
            script,
            [args.group] if args.group is not None else args.groups,
            address,
            max_restarts=args.max_restarts,
            host=host,
            warm=not args.cold,
            nproc_per_group=args.nproc_per_group,
        )
        try:
            codes = [proc.wait() for proc in procs]
        finally:
            stop_groups(procs)
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
