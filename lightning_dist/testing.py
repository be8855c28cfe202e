"""Run one function per rank in threads, each with a real Gloo process group: the multi-rank
test harness (no processes to spawn, so a 3-rank check takes milliseconds)."""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from lightning_dist.collectives import Communicator, TorchBackend

T = TypeVar("T")

FAILURE_GRACE_S = 5.0
"""After a rank fails, how long the other ranks get to finish before the failure is raised."""


def run_in_threads(world_size: int, fn: Callable[[Communicator], T], timeout: float = 60.0) -> list[T]:
    """Call ``fn(comm)`` on ``world_size`` ranks at once; returns results in rank order.

    Each rank gets its own ``ProcessGroupGloo`` and its own communicator (with its own ``stats``).
    The whole call has one deadline, ``timeout`` seconds from now: ranks still running then raise
    ``TimeoutError`` here.
    When a rank raises, the first failure is re-raised here; the failing rank's frames are cleared
    so that its group closes, and ranks blocked on it fail at once instead of waiting out the
    timeout. Gloo cannot abort an operation in flight (``abort()`` does nothing on it), so a rank
    that stays blocked is a daemon thread released by its group's own ``timeout``.
    """
    deadline = time.monotonic() + timeout
    store = dist.HashStore()
    prefix = uuid.uuid4().hex
    results: list[object] = [None] * world_size
    failures: list[tuple[int, BaseException]] = []  # in the order ranks failed
    finished: set[int] = set()
    kept: list[Communicator] = []  # the finished ranks' communicators, dropped by this thread
    cond = threading.Condition()
    give_up = deadline

    def _rank(r: int) -> None:
        nonlocal give_up
        # only this list holds the group: emptied on failure, so clearing fn's frames releases it
        holder = [
            Communicator(
                TorchBackend(
                    dist.ProcessGroupGloo(
                        dist.PrefixStore(prefix, store), r, world_size, timedelta(seconds=timeout)
                    )
                )
            )
        ]
        try:
            results[r] = fn(holder[0])
            # Callbacks fn chained on its futures may hold the communicator; they are released in
            # the group's own worker thread, and a group destroyed there aborts the process. The
            # barrier lets them finish; the caller's thread then drops the group (``kept``).
            holder[0].backend.barrier()  # not counted or traced: the harness's own call
            kept.append(holder.pop())
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller)
            holder.clear()
            with cond:
                failures.append((r, exc))
                give_up = min(give_up, time.monotonic() + FAILURE_GRACE_S)
                cond.notify_all()
            traceback.clear_frames(exc.__traceback__)
        finally:
            with cond:
                finished.add(r)
                cond.notify_all()

    threads = [
        threading.Thread(target=_rank, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    with cond:
        while len(finished) < world_size and time.monotonic() < give_up:
            cond.wait(max(0.0, give_up - time.monotonic()))
        running = sorted(set(range(world_size)) - finished)
    kept.clear()
    if failures:
        r, err = failures[0]
        extra = f" (ranks {running} still running)" if running else ""
        raise RuntimeError(f"rank {r} failed: {err!r}{extra}") from err
    if running:
        raise TimeoutError(f"ranks {running} did not finish within {timeout}s (deadlocked collective?)")
    return results  # type: ignore[return-value]
