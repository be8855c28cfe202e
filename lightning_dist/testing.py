"""Run one function per rank in threads, each with a real Gloo process group: the multi-rank
test harness (no processes to spawn, so a 3-rank check takes milliseconds)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from lightning_dist.collectives import CommStats, Communicator, TorchBackend

T = TypeVar("T")


def run_in_threads(world_size: int, fn: Callable[[Communicator], T], timeout: float = 60.0) -> list[T]:
    """Call ``fn(comm)`` on ``world_size`` ranks at once; returns results in rank order.

    Each rank gets its own ``ProcessGroupGloo`` and its own ``CommStats``. An exception on any rank
    is re-raised here; a rank that does not finish within ``timeout`` seconds fails the call.
    """
    store = dist.HashStore()
    prefix = uuid.uuid4().hex
    results: list[object] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def _rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store), r, world_size, timedelta(seconds=timeout)
            )
            results[r] = fn(Communicator(TorchBackend(pg), stats=CommStats()))
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller)
            errors[r] = exc

    threads = [threading.Thread(target=_rank, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank did not finish within {timeout}s (deadlocked collective?)")
    for r, err in enumerate(errors):
        if err is not None:
            raise RuntimeError(f"rank {r} failed: {err!r}") from err
    return results  # type: ignore[return-value]
