"""The trace of a run that failed: each rank writes its own records at once, and whichever rank
writes last merges what exists into one Chrome trace per attempt.

A failing run cannot gather: a rank may be dead, stopped or stuck in the collective that failed. So
every rank writes ``<stem>-attempt-<n>.rank<r>.json`` (its exported recorder, the reason, the
attempt) the moment it fails, then, holding a lock file in the same directory (``fcntl.flock``: one
machine, or a file system that honours it), merges every rank file of the attempt present into
``<stem>-attempt-<n>.json``. Of two ranks writing at once, the one that takes the lock second sees
both files, so the merged trace holds every rank that wrote. ``merge_attempt`` does the same from
outside (after the job, on any node that sees the files).

An *attempt* is one start of the processes: ``TORCHELASTIC_RESTART_COUNT`` under torchrun,
``SLURM_RESTART_COUNT`` under a requeued SLURM job, else one more than the attempts already traced
in the directory (rank 0 counts, the others are told at fit start).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

__all__ = ["attempt_from_env", "attempt_path", "merge_attempt", "next_attempt", "rank_path", "write_rank"]

_ATTEMPT_ENV = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def attempt_from_env() -> Optional[int]:
    """The attempt number the launcher tells (torchrun's restart count, SLURM's requeue count)."""
    for name in _ATTEMPT_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def attempt_path(path: Path, attempt: int) -> Path:
    """``timeline.json`` -> ``timeline-attempt-<attempt>.json``: the merged trace of one attempt."""
    return path.with_name(f"{path.stem}-attempt-{attempt}{path.suffix or '.json'}")


def rank_path(path: Path, attempt: int, rank: int) -> Path:
    """One rank's records of one attempt, next to the merged trace."""
    return path.with_name(f"{path.stem}-attempt-{attempt}.rank{rank}.json")


def next_attempt(path: Path) -> int:
    """One more than the highest attempt traced next to ``path`` (0 if none)."""
    pattern = re.compile(rf"^{re.escape(path.stem)}-attempt-(\d+)[.]")
    found = [
        int(m.group(1)) for p in path.parent.glob(f"{path.stem}-attempt-*") if (m := pattern.match(p.name))
    ]
    return max(found, default=-1) + 1


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as fh:
        try:
            import fcntl

            fcntl.flock(fh, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock here: merge unlocked
            pass
        yield


def merge_attempt(
    path: Path, attempt: int, chrome_trace: Callable[[list[dict[str, Any]]], dict[str, Any]]
) -> Optional[dict[str, Any]]:
    """Merge the rank files of ``attempt`` present next to ``path`` into its attempt trace (returned;
    ``None`` if there are none). ``chrome_trace``: ``timeline.chrome_trace``."""
    target = attempt_path(path, attempt)
    with _locked(target):
        parts = []
        for r_file in sorted(path.parent.glob(f"{path.stem}-attempt-{attempt}.rank*.json")):
            with contextlib.suppress(OSError, ValueError):
                parts.append(json.loads(r_file.read_text()))
        if not parts:
            return None
        parts.sort(key=lambda p: int(p["rank"]))
        data = chrome_trace(parts)
        data["otherData"].update(
            attempt=attempt,
            failed=True,
            reasons={str(p["rank"]): p.get("reason", "") for p in parts},
        )
        _write_json(target, data)
        return data


def write_rank(path: Path, attempt: int, part: dict[str, Any]) -> Path:
    """Write one rank's ``part`` (``{"rank", "reason", **Recorder.export()}``) for ``attempt``."""
    out = rank_path(path, attempt, int(part["rank"]))
    _write_json(out, {**part, "attempt": attempt})
    return out
