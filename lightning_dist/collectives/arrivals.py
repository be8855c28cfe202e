"""``Arrivals``: when this rank reached each collective, on the clock every rank shares.

A straggler report compares, call by call, when each rank posted the same collective: the last to
arrive makes the others wait. The hot path only appends ``(seq, op, unix_ns)`` while recording is
on (off, the default, it costs one attribute check per call); the comparison happens later, when a
caller gathers the entries of every rank (``lightning_dist.callbacks.stragglers``).

``seq`` numbers the collectives this communicator posted since ``start()``: ranks post collectives
in the same order, so equal ``seq`` on two ranks is the same call. Point-to-point ``send``/``recv``
are not collectives and are not recorded. The clock is Unix time (``time.time_ns`` at ``start``
plus ``perf_counter_ns`` since): exact between ranks of one machine, NTP-close across nodes.
"""

from __future__ import annotations

import threading
import time
from collections import deque

__all__ = ["Arrivals"]


class Arrivals:
    """This communicator's collective postings, numbered, in Unix nanoseconds, while ``on``."""

    def __init__(self, maxlen: int = 65536) -> None:
        self.on = False
        self._lock = threading.Lock()
        self._log: deque[tuple[int, str, int]] = deque(maxlen=maxlen)
        self._seq = 0
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def start(self) -> None:
        """Number from 0 again, forget earlier entries and record from now (every rank at the same point)."""
        with self._lock:
            self._log.clear()
            self._seq = 0
            self._offset_ns = time.time_ns() - time.perf_counter_ns()
            self.on = True

    def stop(self) -> None:
        self.on = False

    def add(self, op: str, perf_ns: int) -> None:
        """Collective ``op`` was posted at ``perf_ns`` (``time.perf_counter_ns``)."""
        with self._lock:
            self._log.append((self._seq, op, perf_ns + self._offset_ns))
            self._seq += 1

    def take(self) -> list[tuple[int, str, int]]:
        """The entries recorded since the last ``take``, oldest first (and forget them)."""
        with self._lock:
            out = list(self._log)
            self._log.clear()
            return out
