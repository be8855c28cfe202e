"""Per-call tracing of collectives: what ``Timeline`` (``lightning_dist.callbacks``) draws.

While a ``Recorder`` is active (``start``/``stop`` or ``recording()``), every ``Communicator`` in
this process adds one ``CollectiveEvent`` per operation: its op, the bytes the wire model counts
(the same as the communicator's ``stats``), when it was posted and when its future completed (asynchronous calls:
posting and completion may be on different threads, and several may be in flight at once), the
posting thread and the communicator's rank. Off (the default) it costs one ``None`` check per call.

Timestamps are ``time.perf_counter_ns()``; ``Recorder.clock_offset_ns`` turns them into Unix time
(``time.time_ns()``), the clock that lines up the ranks of one machine (and of NTP-synchronised
nodes) in a merged trace. World size 1 records nothing: nothing crosses a wire.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

__all__ = ["CollectiveEvent", "Recorder", "Span", "active", "now_ns", "recording", "start", "stop"]

now_ns = time.perf_counter_ns
"""The recorder's clock."""


class CollectiveEvent(NamedTuple):
    """One collective operation on one rank (times in ``perf_counter_ns``)."""

    op: str
    """``all_reduce``, ``broadcast``, ``all_gather``, ``send``, ``adasum``..., as in ``Communicator.stats``."""
    start_ns: int
    """When it was posted (a held-back call: when it was really posted)."""
    end_ns: int
    """When its future completed (a blocking call: when it returned)."""
    bytes_sent: int
    bytes_received: int
    rank: int
    """The communicator's rank in its group."""
    world_size: int
    thread: str
    """The thread that posted it."""
    detail: str = ""
    """What it moved (``"sum, 1234 float32 elements"``)."""
    status: str = ""
    """``""``: completed; ``"timed out"`` or ``"failed"``: its future (or call) raised; ``"in flight"``:
    posted and not completed when the recorder was exported (``end_ns`` is then the export time)."""


class Span(NamedTuple):
    """A named interval recorded by a caller (a training step's forward, say)."""

    name: str
    start_ns: int
    end_ns: int
    args: dict[str, Any]


class Recorder:
    """Collects ``CollectiveEvent``s (from any thread) and caller ``Span``s."""

    def __init__(self) -> None:
        self.events: list[CollectiveEvent] = []
        self.spans: list[Span] = []
        self.open: dict[int, CollectiveEvent] = {}
        """Calls posted and not completed yet, by the key ``posted`` returned."""
        self._keys = itertools.count(1)
        self.clock_offset_ns = time.time_ns() - time.perf_counter_ns()
        """Add to a ``perf_counter_ns`` value to get Unix time in nanoseconds."""

    def posted(
        self,
        op: str,
        start_ns: int,
        rank: int,
        world_size: int,
        thread: Optional[str] = None,
        detail: str = "",
    ) -> int:
        """Note a call as in flight from ``start_ns``; returns its key for ``collective``/``settled``."""
        key = next(self._keys)
        name = threading.current_thread().name if thread is None else thread
        self.open[key] = CollectiveEvent(
            op, start_ns, start_ns, 0, 0, rank, world_size, name, detail, "in flight"
        )
        return key

    def settled(self, key: int) -> None:
        """The call ``posted`` returned ``key`` for is no longer in flight."""
        self.open.pop(key, None)

    def collective(
        self,
        op: str,
        start_ns: int,
        end_ns: int,
        sent: int,
        received: int,
        rank: int,
        world_size: int,
        thread: Optional[str] = None,
        detail: str = "",
        status: str = "",
        key: int = 0,
    ) -> None:
        """Add one operation (``list.append`` is atomic: safe from transport threads); ``key``: the
        one ``posted`` returned for it, which is no longer in flight."""
        name = threading.current_thread().name if thread is None else thread
        self.events.append(
            CollectiveEvent(
                op, start_ns, end_ns, int(sent), int(received), rank, world_size, name, detail, status
            )
        )
        if key:
            self.open.pop(key, None)

    def span(self, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        self.spans.append(Span(name, start_ns, end_ns, args))

    def export(self) -> dict[str, Any]:
        """Plain, picklable data: events and spans as tuples, and the clock offset. Calls still in
        flight come last, with status ``"in flight"`` and the export time as their end."""
        now = now_ns()
        pending = [e._replace(end_ns=max(now, e.start_ns)) for e in list(self.open.values())]
        return {
            "clock_offset_ns": self.clock_offset_ns,
            "events": [tuple(e) for e in (*self.events, *pending)],
            "spans": [tuple(s) for s in self.spans],
        }


active: Optional[Recorder] = None
"""The recorder communicators add to; ``None``: tracing is off."""


def start(recorder: Optional[Recorder] = None) -> Recorder:
    """Make ``recorder`` (a new one by default) the active recorder and return it."""
    global active
    active = Recorder() if recorder is None else recorder
    return active


def stop(recorder: Optional[Recorder] = None) -> Optional[Recorder]:
    """Turn tracing off (only if ``recorder``, when given, is the active one); returns what was active."""
    global active
    previous = active
    if recorder is None or previous is recorder:
        active = None
    return previous


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """``with recording() as rec:`` traces the collectives of the block."""
    rec = start()
    try:
        yield rec
    finally:
        stop(rec)
