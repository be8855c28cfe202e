"""Per-communicator counters of bytes moved and time spent in collectives.

Byte counts follow a stated wire model per algorithm (``lightning_dist.compression.wire``), so they
are exact and comparable across backends rather than sampled from a network interface.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_dist.compression.wire import ring_all_reduce_bytes

__all__ = ["CommStats", "OpStats", "ring_all_reduce_bytes"]


@dataclass
class OpStats:
    """Totals for one collective kind (``all_reduce``, ``broadcast`` ...)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


_FIELDS = tuple(f.name for f in fields(OpStats))  # calls, bytes_sent, bytes_received, seconds
_TOTALS = ("bytes_sent", "bytes_received", "seconds", "calls")  # the order of ``snapshot``


def _total(name: str) -> Any:
    """A read-only property: ``OpStats.<name>`` summed over every op."""

    def get(self: CommStats) -> Any:
        with self._lock:
            return self._sum(name)

    return property(get, doc=f"``{name}`` summed over every op.")


@dataclass
class CommStats:
    """Counters one communicator adds to on every call; read with ``snapshot`` and zero with ``reset``.

    ``seconds`` adds up each collective's time from posting to completion, so collectives in flight
    together (Horovod's one all-reduce per tensor) count several times over; ``busy_seconds`` is the
    wall time during which at least one collective was in flight (the union of those intervals), which
    never exceeds the elapsed time.
    """

    per_op: dict[str, OpStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _in_flight: int = field(default=0, repr=False, compare=False)
    _busy_since_ns: int = field(default=0, repr=False, compare=False)
    _busy_ns: int = field(default=0, repr=False, compare=False)

    def enter(self, now_ns: int) -> None:
        """A collective was posted at ``now_ns`` (``time.perf_counter_ns``)."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since_ns = now_ns
            self._in_flight += 1

    def leave(self, now_ns: int) -> None:
        """A collective posted with ``enter`` completed at ``now_ns``."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            if self._in_flight == 0:
                self._busy_ns += max(0, now_ns - self._busy_since_ns)

    def add_busy(self, seconds: float) -> None:
        """Busy time of a caller-driven exchange (it ran alone in call order, nothing overlapped it
        unless other collectives were in flight, whose interval already covers it)."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_ns += int(seconds * 1e9)

    def _busy_seconds(self) -> float:
        busy = self._busy_ns
        if self._in_flight:
            busy += max(0, time.perf_counter_ns() - self._busy_since_ns)
        return busy / 1e9

    @property
    def busy_seconds(self) -> float:
        """Wall seconds with at least one collective in flight (an open interval counts up to now)."""
        with self._lock:
            return self._busy_seconds()

    def add(self, op: str, sent: int, received: int, seconds: float = 0.0) -> None:
        with self._lock:
            entry = self.per_op.setdefault(op, OpStats())
            entry.calls += 1
            entry.bytes_sent += int(sent)
            entry.bytes_received += int(received)
            entry.seconds += seconds

    def add_time(self, op: str, seconds: float) -> None:
        with self._lock:
            self.per_op.setdefault(op, OpStats()).seconds += seconds

    def _sum(self, name: str) -> Any:
        return sum(getattr(s, name) for s in self.per_op.values())

    bytes_sent = _total("bytes_sent")
    bytes_received = _total("bytes_received")
    seconds = _total("seconds")
    calls = _total("calls")

    def snapshot(self) -> dict[str, float]:
        """Flat totals plus ``<op>.bytes_sent`` style entries, for logging."""
        with self._lock:
            out: dict[str, float] = {name: self._sum(name) for name in _TOTALS}
            out["busy_seconds"] = self._busy_seconds()
            for op, s in self.per_op.items():
                for name in _FIELDS:
                    out[f"{op}.{name}"] = getattr(s, name)
            return out

    def reset(self) -> None:
        with self._lock:
            self.per_op.clear()
            self._busy_ns = 0
            self._busy_since_ns = time.perf_counter_ns()
