"""Straggler maths: per collective, who arrived last and how long the others waited for it.

For call k with arrival times ``start_k(r)`` (one per rank, on a common clock), the last arrival is
``last_k = max_r start_k(r)``, rank r's wait is ``last_k - start_k(r)`` and the straggler of the call
is the argmax (the lowest rank on a tie). ``StragglerReport`` adds these up per rank: total wait,
how many calls the rank was last at, and (when given) its step time, for the share of the step it
spent waiting. ``gather_arrivals`` brings every rank's ``Communicator.arrivals`` together through
the communicator (one ``all_gather``), so the hot path only records a timestamp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from lightning_dist.collectives import Communicator

__all__ = ["CallWaits", "StragglerReport", "call_waits", "gather_arrivals"]


@dataclass(frozen=True)
class CallWaits:
    """One collective call: ``last_ns`` (the last arrival), ``straggler`` (its rank), ``wait_ns``
    (each rank's wait, the straggler's 0)."""

    last_ns: int
    straggler: int
    wait_ns: tuple[int, ...]


def call_waits(starts: Sequence[int]) -> CallWaits:
    """The waits of one call from its arrival time on each rank (index = rank)."""
    if not starts:
        raise ValueError("starts: needs one arrival time per rank, got none")
    last = max(starts)
    return CallWaits(int(last), list(starts).index(last), tuple(int(last - s) for s in starts))


@dataclass
class StragglerReport:
    """Per-rank totals over the collectives added so far (``add``)."""

    world_size: int
    calls: int = 0
    wait_ns: list[int] = field(default_factory=list)
    last_count: list[int] = field(default_factory=list)
    step_seconds: Optional[list[float]] = None
    """Each rank's total step time, where known: the denominator of ``wait_share``."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be >= 1")
        self.wait_ns = self.wait_ns or [0] * self.world_size
        self.last_count = self.last_count or [0] * self.world_size

    def add(self, starts: Sequence[int]) -> CallWaits:
        """Add one call (its arrival time on each rank); returns its ``CallWaits``."""
        if len(starts) != self.world_size:
            raise ValueError(
                f"starts: needs {self.world_size} arrival times (one per rank), got {len(starts)}"
            )
        w = call_waits(starts)
        self.calls += 1
        self.last_count[w.straggler] += 1
        for r, ns in enumerate(w.wait_ns):
            self.wait_ns[r] += ns
        return w

    def wait_s(self, rank: int) -> float:
        """Seconds ``rank`` waited in total for the last rank of each call."""
        return self.wait_ns[rank] / 1e9

    def last_share(self, rank: int) -> float:
        """The fraction of the calls at which ``rank`` was the last to arrive (0 with no calls)."""
        return self.last_count[rank] / self.calls if self.calls else 0.0

    def straggler(self) -> Optional[int]:
        """The rank most often last (the lowest on a tie); ``None`` with no calls."""
        if not self.calls:
            return None
        return max(range(self.world_size), key=lambda r: (self.last_count[r], -r))

    def wait_share(self, rank: int) -> Optional[float]:
        """``wait_s(rank)`` over the rank's step time, where that is known and positive."""
        if self.step_seconds is None or not self.step_seconds[rank] > 0:
            return None
        return self.wait_s(rank) / self.step_seconds[rank]

    def merge(self, other: StragglerReport) -> None:
        """Add ``other``'s calls and waits (an interval's) to these."""
        self.calls += other.calls
        for r in range(self.world_size):
            self.wait_ns[r] += other.wait_ns[r]
            self.last_count[r] += other.last_count[r]

    def table(self) -> str:
        """A plain-text table, one row per rank, and a sentence naming the straggler."""
        rows = [f"{'rank':>4}  {'last at':>8}  {'wait s':>9}  {'step waiting':>12}"]
        for r in range(self.world_size):
            share = self.wait_share(r)
            waiting = f"{100 * share:11.1f}%" if share is not None else f"{'-':>12}"
            rows.append(f"{r:>4}  {100 * self.last_share(r):7.1f}%  {self.wait_s(r):9.3f}  {waiting}")
        s = self.straggler()
        if s is not None:
            others = [self.wait_share(r) for r in range(self.world_size) if r != s]
            known = [x for x in others if x is not None]
            tail = (
                f", the others waited {100 * sum(known) / len(known):.0f}% of their step for it"
                if known
                else ""
            )
            rows.append(
                f"rank {s} was last at {100 * self.last_share(s):.0f}% of {self.calls} collectives{tail}"
            )
        return "\n".join(rows)


def gather_arrivals(
    comm: Communicator, entries: Sequence[tuple[int, str, int]], step_seconds: Optional[float] = None
) -> tuple[list[list[int]], Optional[list[float]]]:
    """Every rank's arrival ``entries`` (``Arrivals.take()``: seq, op, unix ns), matched by ``seq``:
    one row per call every rank has, each a list of arrival times in rank order; and, when
    ``step_seconds`` is given, every rank's. Called on every rank at the same point (it is one
    ``all_gather`` of unequal lengths through ``comm``: a shape exchange, then the data); its own
    calls are not recorded in ``comm.arrivals``."""
    rows = [[seq, ns] for seq, _, ns in entries]
    if step_seconds is not None:
        rows.append([-1, int(step_seconds * 1e9)])
    local = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
    was_on = comm.arrivals.on
    comm.arrivals.stop()
    try:
        parts = [g.cpu() for g in comm.all_gather(comm.backend.to_transport_device(local))]
    finally:
        comm.arrivals.on = was_on
    per_rank: list[dict[int, int]] = [{int(s): int(t) for s, t in p.tolist()} for p in parts]
    common = sorted(set.intersection(*(set(d) for d in per_rank)) - {-1})
    matrix = [[d[seq] for d in per_rank] for seq in common]
    steps = [d[-1] / 1e9 for d in per_rank] if step_seconds is not None else None
    return matrix, steps
