"""``FutureWork``: a collective's future as a ``torch.distributed`` ``Work``.

For extension points that keep the ``Work`` a collective returns and wait on it later (FSDP2's
custom all-gather: ``foreach_all_gather_copy_out`` waits on it only if it is a ``Work``), so the
operation overlaps whatever runs before that wait. torch's own
``torch._C._distributed_c10d._create_work_from_future`` would do, but its ``wait()`` returns normally
when the future failed (seen on torch 2.13): a failed all-gather would hand back uninitialised
buffers. Here ``wait()`` is the communicator's blocking wait, which raises the operation's error (a
timeout as ``CollectiveTimeout``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from torch.futures import Future
from typing_extensions import override


class FutureWork(dist.distributed_c10d.Work):
    """``future`` as a ``Work``: ``wait()`` calls ``wait`` (blocking until ``future`` completes and
    raising its error), ``is_completed()`` and ``get_future()`` are the future's."""

    def __init__(self, future: Future, wait: Callable[[], Any]) -> None:
        super().__init__()
        self._future = future
        self._waiter = wait

    @override
    def wait(self, timeout: Optional[timedelta] = None) -> bool:  # type: ignore[override]
        self._waiter()
        return True

    @override
    def is_completed(self) -> bool:
        return bool(self._future.done())

    @override
    def get_future(self) -> Future:
        return self._future
