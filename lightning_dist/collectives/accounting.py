"""Per-communicator counters of bytes moved and time spent in collectives.

Byte counts follow a stated wire model per algorithm (see ``wire_bytes``), so they are exact and
comparable across backends rather than sampled from a network interface.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class OpStats:
    """Totals for one collective kind (``all_reduce``, ``broadcast`` ...)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Counters one communicator adds to on every call; read with ``snapshot`` and zero with ``reset``."""

    per_op: dict[str, OpStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

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

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.per_op.values())

    @property
    def bytes_received(self) -> int:
        return sum(s.bytes_received for s in self.per_op.values())

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.per_op.values())

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.per_op.values())

    def snapshot(self) -> dict[str, float]:
        """Flat totals plus ``<op>.bytes_sent`` style entries, for logging."""
        with self._lock:
            out: dict[str, float] = {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "seconds": self.seconds,
                "calls": self.calls,
            }
            for op, s in self.per_op.items():
                out[f"{op}.calls"] = s.calls
                out[f"{op}.bytes_sent"] = s.bytes_sent
                out[f"{op}.bytes_received"] = s.bytes_received
                out[f"{op}.seconds"] = s.seconds
            return out

    def reset(self) -> None:
        with self._lock:
            self.per_op.clear()


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce: reduce-scatter then all-gather."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * nbytes // world_size
