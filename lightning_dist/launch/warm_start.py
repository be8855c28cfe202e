"""Warm restarts under torchrun: a standby per replica group that has torch, Lightning and torchft
imported once and forks a ready worker whenever torchrun (re)starts one.

    python -m lightning_dist.launch.warm_start --script train.py -- \\
        torchrun --standalone --nproc-per-node=1 --max-restarts=3 .../launch/warm_worker.py train.py args

The standby imports the heavy modules (``PRELOAD`` and the script's own top-level imports), then runs
the torchrun command as its child with ``$LD_WARM_SOCKET`` set. torchrun's entrypoint is
``warm_worker.py`` (standard library only), which hands its arguments, environment, working directory
and stdio to the standby; the standby forks, and the child runs the script (``runpy``) with exactly
that environment. torchrun still starts, watches and restarts the worker (the stand-in relays its
exit status and torchrun's signals), so a restart costs torchrun's notice and a fork instead of a
fresh interpreter importing torch and Lightning: most of a cold restart.

Fork safety: the standby never starts a thread of its own, runs no tensor operation, and forks from
a single-threaded select loop; the child reseeds Python's (and NumPy's) global random state from the
OS, as a fresh interpreter would. Only processes of this user reach the socket (a 0700 directory,
and the peer's uid is checked). The standby ends as torchrun ended (its exit code, or the signal that killed it).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_dist.launch.warm_worker import SOCKET_ENV, end_like

WORKER = Path(__file__).with_name("warm_worker.py")
"""torchrun's entrypoint for a warm group (run as a file)."""
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning",
    "lightning.pytorch",
    "lightning_dist",
    "lightning_dist.strategies.fault_tolerant",
    "torchft",
    "torchft.manager",
    "torchft.process_group",
    "torchft.checkpointing.http_transport",
)
"""What every standby imports before torchrun starts (a module that is not installed is skipped)."""


def script_imports(path: str) -> list[str]:
    """The absolute modules ``path`` imports at its top level (what its worker would import first)."""
    try:
        tree = ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules`` (best effort: the worker imports them again and reports its own errors);
    returns the ones that failed."""
    failed = []
    for name in dict.fromkeys(modules):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (any import error; the worker will raise it itself)
            failed.append(name)
    return failed


@dataclass
class Job:
    """What a stand-in sent: the worker's arguments, environment, working directory and stdio."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    unbuffered: bool
    fds: list[int]


def _receive(conn: socket.socket) -> Job:
    conn.settimeout(10)
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    uid = struct.unpack("3i", creds)[1]
    if uid != os.getuid():
        raise PermissionError(f"warm_start: a process of uid {uid} connected; only uid {os.getuid()} may")
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(header) != 4 or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("warm_start: the stand-in sent no stdio")
    size = struct.unpack("!I", header)[0]
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("warm_start: the stand-in closed before its request was complete")
        data += chunk
    req = json.loads(data)
    conn.settimeout(None)
    return Job(list(req["argv"]), dict(req["env"]), str(req["cwd"]), bool(req["unbuffered"]), fds)


def _recv_or_eof(conn: socket.socket) -> bool:
    """Whether a readable stand-in socket is still open (it sends nothing after its request)."""
    try:
        return bool(conn.recv(64))
    except OSError:
        return False


class Standby:
    """The group's standby: serves fork requests on a Unix socket while its torchrun runs."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="ld-warm-")  # 0700: this user only
        self.path = os.path.join(self._dir, "standby.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(8)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers: dict[int, socket.socket] = {}
        self._sel = selectors.DefaultSelector()
        self._pid = os.getpid()

    def serve(self, command: Sequence[str], env: dict[str, str]) -> tuple[Optional[Job], int]:
        """Run ``command`` (torchrun) and fork a worker for each stand-in until it exits. Returns
        ``(job, 0)`` in a forked worker, ``(None, torchrun's exit code)`` in the standby."""
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w)
        torchrun = subprocess.Popen(list(command), env={**env, SOCKET_ENV: self.path})

        def stop(signum: int, frame: Any) -> None:
            if torchrun.poll() is None:
                torchrun.send_signal(signum)  # torchrun stops its workers, then exits

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        sel = self._sel
        sel.register(self._listener, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while True:
                self._reap()
                if torchrun.poll() is not None and not self._workers:
                    return None, torchrun.returncode
                for key, _ in sel.select(timeout=0.5):
                    if key.data == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    elif key.data == "accept":
                        job = self._accept()
                        if job is not None:  # the forked worker
                            return job, 0
                    elif not _recv_or_eof(key.fileobj):  # type: ignore[arg-type]
                        # the stand-in is gone (torchrun killed it): its worker goes too
                        sel.unregister(key.fileobj)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(key.data, signal.SIGKILL)
        finally:
            if os.getpid() == self._pid:
                self._close(torchrun)

    def _accept(self) -> Optional[Job]:
        conn, _ = self._listener.accept()
        try:
            job = _receive(conn)
        except (OSError, ValueError, KeyError) as err:
            print(f"warm_start: refused a request: {err}", file=sys.stderr, flush=True)
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._in_child(conn)
            return job
        for fd in job.fds:
            os.close(fd)
        self._workers[pid] = conn
        conn.sendall(f"pid {pid}\n".encode())
        self._sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def _in_child(self, conn: socket.socket) -> None:
        """In the forked worker: drop everything of the standby's."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self._sel.close()
        for sock in (self._listener, conn, *self._workers.values()):
            sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _reap(self) -> None:
        """Tell each stand-in whose worker ended how it ended."""
        for pid, conn in list(self._workers.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self._workers[pid]
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()

    def _close(self, torchrun: subprocess.Popen[bytes]) -> None:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
        for pid in list(self._workers):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


def run_job(job: Job) -> None:
    """Run the stand-in's worker in this (forked) process, as ``python -u <argv>`` would."""
    for target, fd in enumerate(job.fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(job.env)
    os.chdir(job.cwd)
    if job.unbuffered:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    import random

    random.seed()  # fresh entropy, as a new interpreter has (the standby's state is shared)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if job.argv[0] == "-m":
        sys.argv = job.argv[1:]
        runpy.run_module(job.argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(job.argv)
        sys.path[0] = os.path.dirname(os.path.abspath(job.argv[0]))
        runpy.run_path(job.argv[0], run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dist.launch.warm_start", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--script", default=None, help="the training script (its imports are preloaded)")
    parser.add_argument("--preload", action="append", default=[], help="another module to import first")
    parser.add_argument("--bare", action="store_true", help="import only --preload and the script's imports")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ... warm_worker.py train.py")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the torchrun command after --")
    script = [args.script] if args.script else []
    preload([*([] if args.bare else PRELOAD), *args.preload, *(n for s in script for n in script_imports(s))])
    job, code = Standby().serve(command, dict(os.environ))
    if job is not None:
        run_job(job)
        return 0
    end_like(code)  # as torchrun ended: its exit code, or killed by the same signal
    return code


if __name__ == "__main__":
    sys.exit(main())
