"""torchrun's entrypoint for a warm-started replica group: hands this worker over to the group's standby.

    torchrun ... lightning_dist/launch/warm_worker.py train.py args     (run as a file, never imported)

torchrun starts this file as its worker. It imports only the standard library (it is running in
tens of milliseconds), connects to the standby at ``$LD_WARM_SOCKET`` (``warm_start.py``), sends its
arguments, environment, working directory and stdin/stdout/stderr, and the standby forks the real
worker from a process that has torch, Lightning and torchft imported already. This process then
stands in for the worker towards torchrun: it forwards the signals torchrun sends (SIGTERM on a
stop) and ends as the worker ended (its exit code, or killed by the same signal), so torchrun sees
and restarts the group as if it had started the worker itself. Without a reachable standby it runs
the script itself (``exec`` of a cold Python), so nothing depends on the standby being there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV = "LD_WARM_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _cold(argv: list[str]) -> None:
    """Run the worker in a fresh interpreter (no standby): replaces this process."""
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def end_like(code: int) -> None:
    """Exit as the worker did: with its code, or killed by its signal (``code`` < 0)."""
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("warm_worker.py: give the training script (and its arguments) after it")
    path = os.environ.get(SOCKET_ENV)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not path:
            raise OSError(f"${SOCKET_ENV} is not set")
        sock.connect(path)
    except OSError as err:
        print(f"warm_worker.py: no standby ({err}); starting the worker cold", file=sys.stderr, flush=True)
        sock.close()
        _cold(argv)
    payload = json.dumps(
        {
            "argv": argv,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "unbuffered": bool(getattr(sys.stdout, "write_through", False)),  # python -u
        }
    ).encode()
    socket.send_fds(sock, [struct.pack("!I", len(payload))], [0, 1, 2])
    sock.sendall(payload)
    reply = sock.makefile("r")
    started = reply.readline().split()
    if started[:1] != ["pid"]:
        sys.exit(f"warm_worker.py: the standby did not start the worker ({' '.join(started) or 'closed'})")
    pid = int(started[1])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    ended = reply.readline().split()
    if ended[:1] != ["exit"]:  # the standby died: take the worker down with it, as torchrun would
        os.kill(pid, signal.SIGKILL)
        end_like(-signal.SIGKILL)
    end_like(int(ended[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
