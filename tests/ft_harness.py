"""Launching and reading FaultTolerant runs of ``tests/scripts/ft_train.py`` for the live-recovery tests:
a Lighthouse and one torchrun per replica group (``launch``/``finish``), and what each group wrote
(``pids``, ``rows``, ``steps``, ``weights``), checked against a fault-free run (``check_against_reference``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from helpers import ROOT, child_env

from lightning_dist.launch.fault_tolerant import Lighthouse, start_groups, stop_groups

SCRIPT = ROOT / "tests" / "scripts" / "ft_train.py"
STEPS = 30
GLOBAL_BATCH = 16
Launch = tuple[Lighthouse, list[subprocess.Popen]]


def _listeners() -> list[tuple[str, int, str]]:
    """(local address hex, port, socket inode) of every listening TCP socket of this machine, as
    /proc/net/tcp{,6} write them."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                addr, port = fields[1].rsplit(":", 1)
                found.append((addr, int(port, 16), fields[9]))
    return found


def listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) with a listening socket on ``port``."""
    return [addr for addr, p, _ in _listeners() if p == port]


def routable_address() -> str:
    """An IPv4 address of this machine other than loopback (skips the test when there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.254", 9))  # no packet is sent: only the route is looked up
        except OSError:
            pytest.skip("no non-loopback IPv4 route on this machine")
        addr = probe.getsockname()[0]
    if addr.startswith("127."):
        pytest.skip("no non-loopback IPv4 address on this machine")
    return addr


def own_listeners() -> set[tuple[str, int]]:
    """(address hex, port) of every listening TCP socket this process holds (not the machine's)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return {(addr, port) for addr, port, inode in _listeners() if inode in inodes}


def launch(
    out: Path, groups: int = 2, steps: int = STEPS, warm: bool = True, nproc_per_group: int = 1, **env: str
) -> Launch:
    """A Lighthouse and ``groups`` torchruns of ``nproc_per_group`` processes (3 restarts each;
    ``warm``: under their standbys) of the test script, writing to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse("127.0.0.1:0")  # the launcher's heartbeat timeout (HEARTBEAT_TIMEOUT_MS)
    log = open(out / "log.txt", "w")  # noqa: SIM115
    procs = start_groups(
        [str(SCRIPT)],
        groups,
        lighthouse.address,
        max_restarts=3,
        env=child_env(FT_OUT=str(out), FT_STEPS=str(steps), FT_GROUPS=str(groups), **env),
        warm=warm,
        nproc_per_group=nproc_per_group,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return lighthouse, procs


def start_launcher(out: Path, *flags: str, **env: str) -> subprocess.Popen:
    """The one-box launcher's command line (``python -m lightning_dist.launch.fault_tolerant``) with
    ``flags``, running the test script into ``out`` (its log: ``out / "log.txt"``)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_dist.launch.fault_tolerant", *flags, "--", str(SCRIPT)],
        env=child_env(FT_OUT=str(out), **env),
        stdout=open(out / "log.txt", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def end_launcher(proc: subprocess.Popen) -> None:
    """End a launcher that is still running: it ends its replica groups, then itself (killed, with
    its session, if it takes longer than 30 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def finish(started: Launch, out: Path, timeout: float) -> None:
    """Wait for every group of ``started`` to exit 0 within ``timeout`` s; end what is left either way."""
    lighthouse, procs = started
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the replica groups did not finish in {timeout} s; log:\n{(out / 'log.txt').read_text()[-6000:]}"
        )
    finally:
        stop_groups(procs)
        lighthouse.shutdown()
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes}; log:\n{(out / 'log.txt').read_text()[-6000:]}"


def name(group: int, rank: int = 0) -> str:
    """The file name part of process ``rank`` of ``group`` (tests/scripts/ft_train.py's ``NAME``)."""
    return str(group) if rank == 0 else f"{group}.{rank}"


def pids(out: Path, group: int, rank: int = 0) -> list[tuple[int, int]]:
    """(torchrun restart count, worker PID) of each attempt of process ``rank`` of ``group``."""
    text = (out / f"pids_{name(group, rank)}.txt").read_text()
    return [tuple(map(int, line.split())) for line in text.split("\n") if line]  # type: ignore[misc]


def rows(out: Path, group: int, rank: int = 0) -> list[dict]:
    """The committed steps process ``rank`` of ``group`` has written so far."""
    path = out / f"steps_{name(group, rank)}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps(out: Path, groups: int = 2, ranks: int = 1) -> dict[int, list[int]]:
    """step -> the samples trained on in it, over all groups' ``ranks`` processes (committed steps only)."""
    samples: dict[int, list[int]] = {}
    for group in range(groups):
        for rank in range(ranks):
            for row in rows(out, group, rank):
                samples.setdefault(row["step"], []).extend(row["indices"])
    return samples


def check_hooks(out: Path, groups: int = 2, ranks: int = 1, exact: bool = False) -> None:
    """Every attempt that ended its fit, of every process: its batch hooks fired once per
    ``training_step``, with the batch that step trained (the script's ``Hooks`` checks each batch and
    its outputs as it goes; ``hooks_*.json`` holds what they saw). ``exact`` (a run without failures):
    the batches are exactly the samples of the process's committed steps."""
    for group in range(groups):
        for rank in range(ranks):
            files = sorted(out.glob(f"hooks_{name(group, rank)}_*.json"))
            assert files, f"no hooks_{name(group, rank)}_*.json in {out}"
            for path in files:
                seen = json.loads(path.read_text())
                assert seen["started"] == seen["ended"] == seen["stepped"], (
                    f"{path.name}: hooks without steps"
                )
            if exact:
                trained = sorted(i for batch in seen["ended"] for i in batch)
                committed = sorted(i for row in rows(out, group, rank) for i in row["indices"])
                assert trained == committed, (
                    f"{path.name}: the hooks saw other samples than the steps trained"
                )


NOISE = ("[INFO] [torchft::", "flight recorder", '"GET /checkpoint/', "got exception")
"""What torchft writes by default and the pack turns off unless asked (``fault_tolerant_logs``):
its servers' INFO lines, the flight recorder warning, the checkpoint requests, and the traceback of
each error its Manager records (the pack's one line per failure says it: ``fault_tolerant_events``)."""

EVENT = re.compile(
    r"FaultTolerant: (group \S+ lost at step \d+ \((process exit|no answer within [\d.]+ s|heartbeats stopped|error: .*)\)"
    r"|quorum of \d+ at step \d+ in \d+\.\d\d s"
    r"|group \S+ healed from group \S+ at step \d+, [\d.]+ [kMG]?B in \d+\.\d\d s"
    r"|step \d+ not committed \(.*\); the quorum runs it again)$"
)
"""The pack's event lines (``fault_tolerant_events``), after the log record's time."""


def events(out: Path) -> list[str]:
    """The run's event lines (``EVENT``), in order, without their timestamps; ``AssertionError`` for
    a line of the pack's logger of another shape."""
    found = []
    for line in (out / "log.txt").read_text().splitlines():
        for what in ("lost at step", "quorum of", "healed from", "not committed"):
            if "FaultTolerant: " in line and what in line:
                text = line[line.index("FaultTolerant: ") :]
                assert EVENT.match(text), f"an event line of another shape: {line!r}"
                found.append(text)
                break
    return found


def kill_to_next_step(out: Path, group: int = 0) -> float:
    """Seconds from the kill of the run in ``out`` (``killed_*``) to ``group``'s next committed step."""
    killed = min(float(p.read_text()) for p in out.glob("killed_*"))
    return min(r["t"] for r in rows(out, group) if r["t"] > killed) - killed


def noisy_lines(out: Path) -> list[str]:
    """The lines of the run's log that only a verbose run should have."""
    return [line for line in (out / "log.txt").read_text().splitlines() if any(n in line for n in NOISE)]


def weights(out: Path, group: int, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"final_{name(group, rank)}.pt", weights_only=True)


def check_against_reference(
    ref: Path,
    out: Path,
    samples: Optional[dict[int, list[int]]] = None,
    groups: int = 2,
    n_steps: int = STEPS,
    global_batch: int = GLOBAL_BATCH,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    ranks: int = 1,
) -> None:
    """Every step of the run in ``out`` (or ``samples``: step -> samples) trained its global batch
    exactly once, the reference's samples, and every process of every group (``ranks`` each; the
    reference's groups have one) ends on the reference's weights (within ``atol``/``rtol``; the
    processes bitwise equal to each other)."""
    reference, faulty = steps(ref, groups), steps(out, groups, ranks) if samples is None else samples
    assert sorted(faulty) == list(range(n_steps))
    for step, indices in faulty.items():
        assert len(indices) == global_batch == len(set(indices)), f"step {step}: a sample lost or repeated"
        assert sorted(indices) == sorted(reference[step]), f"step {step} trained other samples"
    places = [(group, rank) for group in range(groups) for rank in range(ranks)]
    for place in places:
        torch.testing.assert_close(weights(out, *place), weights(ref, 0), atol=atol, rtol=rtol)
    for place in places[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights(out, 0).values(), weights(out, *place).values()))
