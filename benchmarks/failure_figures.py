"""The pure part of ``bench_failure_rate.py``: the kill schedule from a seed, and the figures computed
from the committed steps the replica groups wrote (no processes, no torch), so they are testable.

A *row* is one committed step as one group saw it: ``{"step", "t", "participants", "indices",
"group", "attempt"}`` (``t``: ``time.time()`` right after the commit). A *kill* is
``{"t", "group", "hit"}``: when the driver SIGKILLed which group's worker (``hit``: a live worker was
there to kill).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Optional

Row = dict[str, Any]


def kill_schedule(duration_s: float, every_s: float, groups: int, seed: int) -> list[tuple[float, int]]:
    """(seconds after the window's start, group) of each kill: one every ``every_s`` seconds, at
    ``every_s, 2 * every_s, ...`` strictly before ``duration_s`` (so a bounded number,
    ``ceil(duration_s / every_s) - 1``, and never at the window's end), each of a group drawn
    uniformly from ``range(groups)`` by ``random.Random(seed)``: the same seed, the same schedule."""
    if not (duration_s > 0 and every_s > 0):
        raise ValueError(f"duration_s={duration_s}, every_s={every_s}; accepted: both > 0")
    if groups < 2:
        raise ValueError(f"groups={groups}; accepted: 2 or more (a kill needs a survivor)")
    rng = random.Random(seed)
    count = math.ceil(duration_s / every_s) - 1
    return [(k * every_s, rng.randrange(groups)) for k in range(1, count + 1)]


def commit_times(rows: Iterable[Row]) -> dict[int, float]:
    """step -> when it was first committed (the earliest of the groups' rows of it)."""
    out: dict[int, float] = {}
    for row in rows:
        out[row["step"]] = min(row["t"], out.get(row["step"], math.inf))
    return out


def steps_in_window(rows: Iterable[Row], start: float, end: float) -> list[int]:
    """The distinct steps first committed in ``[start, end)``."""
    return sorted(s for s, t in commit_times(rows).items() if start <= t < end)


def samples_by_step(rows: Iterable[Row]) -> dict[int, list[int]]:
    """step -> the samples trained in it over all groups, one row per (group, step): a group that
    wrote a step twice (a step redone) counts once here, and is counted by ``redone_steps``."""
    seen: set[tuple[int, int]] = set()
    out: dict[int, list[int]] = {}
    for row in rows:
        key = (row["group"], row["step"])
        if key in seen:
            continue
        seen.add(key)
        out.setdefault(row["step"], []).extend(row["indices"])
    return out


def step_status(rows: Sequence[Row], step: int, reference: Sequence[int]) -> str:
    """How ``step`` trained its global batch (``reference``: the fault-free run's samples of it):
    ``ok`` (every sample once); ``unrecorded`` (a participant's row is missing, the others' samples
    are the reference's: that group was killed after the commit, before it wrote the row); ``lost``,
    ``repeated`` or ``other`` (samples outside the reference); ``missing`` (never committed)."""
    mine = [r for r in rows if r["step"] == step]
    if not mine:
        return "missing"
    samples = samples_by_step(mine).get(step, [])
    if len(samples) != len(set(samples)):
        return "repeated"
    if not set(samples) <= set(reference):
        return "other"
    if sorted(samples) == sorted(reference):
        return "ok"
    groups = {r["group"] for r in mine}
    return "unrecorded" if len(groups) < max(r["participants"] for r in mine) else "lost"


def step_statuses(
    rows: Sequence[Row], steps: Iterable[int], reference: dict[int, list[int]]
) -> dict[str, int]:
    """How many of ``steps`` have each ``step_status``."""
    by_step: dict[int, list[Row]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    counts: dict[str, int] = {}
    for step in steps:
        status = step_status(by_step.get(step, []), step, reference.get(step, []))
        counts[status] = counts.get(status, 0) + 1
    return counts


def trained_once(statuses: dict[str, int], global_batch: int) -> int:
    """Samples trained exactly once: the global batch of every step that is ``ok`` or ``unrecorded``."""
    return global_batch * (statuses.get("ok", 0) + statuses.get("unrecorded", 0))


def redone_steps(rows: Iterable[Row]) -> int:
    """Committed steps a group committed again (its restarts' rows included): the target is 0."""
    counts: dict[tuple[int, int], int] = {}
    for row in rows:
        key = (row["group"], row["step"])
        counts[key] = counts.get(key, 0) + 1
    return sum(n - 1 for n in counts.values())


def gaps(rows: Sequence[Row]) -> list[tuple[float, float]]:
    """(start, end) of each step of one group's attempt: consecutive committed steps' times."""
    ordered = sorted(rows, key=lambda r: r["t"])
    return [(a["t"], b["t"]) for a, b in zip(ordered, ordered[1:]) if b["step"] == a["step"] + 1]


def back_at(rows: Iterable[Row], group: int, killed_at: float) -> Optional[float]:
    """When ``group`` first committed a step with a peer after ``killed_at`` (its restart rejoined);
    None: not before the run ended."""
    times = [r["t"] for r in rows if r["group"] == group and r["t"] > killed_at and r["participants"] > 1]
    return min(times, default=None)


def failure_figures(
    rows: Sequence[Row], kills: Sequence[dict[str, Any]], groups: int, start: float, end: float
) -> dict[str, Any]:
    """Per kill that hit: its recovery time (kill to the restarted group's first step with a
    peer; ``inf``: not back before the run ended) and the survivors' slowest step between the kill
    and that rejoin over their median step in the window."""
    by_attempt: dict[tuple[int, int], list[Row]] = {}
    for row in rows:
        by_attempt.setdefault((row["group"], row["attempt"]), []).append(row)
    steps_of: dict[int, list[tuple[float, float]]] = {}
    for (group, _), attempt_rows in by_attempt.items():
        steps_of.setdefault(group, []).extend(gaps(attempt_rows))
    medians = {
        g: statistics.median([b - a for a, b in steps_of.get(g, []) if start <= a and b < end] or [math.nan])
        for g in range(groups)
    }
    recoveries, ratios = [], []
    for kill in kills:
        if not kill["hit"]:
            continue
        back = back_at(rows, kill["group"], kill["t"])
        until = math.inf if back is None else back
        recoveries.append(until - kill["t"])
        for g in range(groups):
            if g == kill["group"]:
                continue
            during = [b - a for a, b in steps_of.get(g, []) if b > kill["t"] and a < until]
            if during and medians[g] > 0:
                ratios.append(max(during) / medians[g])
    return {"recovery_s": recoveries, "slowest_over_median": ratios, "median_step_s": medians}


def healthy_expected_steps(
    rows: Sequence[Row], kills: Sequence[dict[str, Any]], start: float, end: float
) -> float:
    """The steps the window would have committed at the run's own fault-free pace: the rate of
    steps first committed outside every failure (from a kill that hit to the killed group's rejoin,
    or the window's end) times the window. A reference taken under the run's own load, where a
    separate fault-free run meets another load on a shared machine."""
    intervals = []
    for kill in kills:
        if kill["hit"]:
            back = back_at(rows, kill["group"], kill["t"])
            intervals.append((max(start, kill["t"]), min(end, end if back is None else back)))
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    healthy_s = (end - start) - sum(b - a for a, b in merged)
    times = [t for t in commit_times(rows).values() if start <= t < end]
    healthy = [t for t in times if not any(a <= t < b for a, b in merged)]
    return math.nan if healthy_s <= 0 else len(healthy) / healthy_s * (end - start)


def distribution(values: Sequence[float]) -> str:
    """``median (min-max), n=N`` of ``values`` (``-`` when empty)."""
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered):.2f} ({ordered[0]:.2f}-{ordered[-1]:.2f}), n={len(ordered)}"
