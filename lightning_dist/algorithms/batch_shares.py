"""Per-rank shares of a fixed global batch: which samples rank i trains at step s, the weight its
loss takes, and the balancer's new shares from measured speeds. Pure Python and torch (for the
sample order); nothing here imports torch.distributed or lightning.

Terms: B the global batch (samples per optimizer step, all ranks together), W the data-parallel
ranks, a the accumulation (micro-batches per rank per step), b_i rank i's share (sum b_i = B).

Order and steps
  An epoch reads the dataset in the order of ``lightning_dist.elastic.sampler.epoch_order`` (the same
  on every rank); step s of the epoch takes positions [s*B, (s+1)*B) whatever the shares, so every
  sample is read once per epoch (the last ``N mod B`` positions, less than a step, are left out) and
  step s's samples are those of the uniform run's step s.
Split
  Rank i takes the b_i positions after those of ranks 0..i-1, read as a micro-batches whose sizes
  differ by at most one (``micro_sizes``).
Weight
  A micro-batch of m samples has its (mean) loss multiplied by ``W * a * m / B`` before backward
  (``loss_scale``): the mean over ranks of the weighted gradients, which every reduction computes,
  is then the mean gradient over the B samples, the uniform run's update. 1.0 for uniform shares.
Balancer
  From each rank's seconds per sample t_i over a window: b_i proportional to 1/t_i, kept within
  ``[low * B/W, high * B/W]`` (and at least a), rounded by largest remainder so the sum is B
  (``balanced_shares``). Every rank computes it from the same gathered times, so every rank gets
  the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_dist.checks import check_int, check_number

__all__ = [
    "Balance",
    "ShareSchedule",
    "balanced_shares",
    "loss_scale",
    "micro_sizes",
    "rank_positions",
    "round_shares",
]

OWNER = "shares"


@dataclass(frozen=True)
class Balance:
    """The balancer's options: ``shares=Balance(window=20)`` (or ``shares="balanced"``)."""

    window: int = 20
    """Optimizer steps per measurement; shares are agreed at every multiple of it."""
    low: float = 0.25
    """No rank's share below ``low`` times the uniform share B/W (and never below the accumulation)."""
    high: float = 4.0
    """No rank's share above ``high`` times the uniform share B/W."""
    min_change: float = 0.02
    """Keep the shares unless some rank's share moves by at least this fraction of B (and at least
    one sample): timing noise does not re-plan every window."""

    def __post_init__(self) -> None:
        check_int("window", self.window, 1, owner=OWNER)
        check_number("low", self.low, 0, 1, owner=OWNER)
        if not (isinstance(self.high, (int, float)) and not isinstance(self.high, bool) and self.high >= 1):
            raise ValueError(f"{OWNER}: high={self.high!r} must be a number >= 1")
        check_number("min_change", self.min_change, 0, 1, owner=OWNER)


SharesSpec = Union[None, str, Sequence[float], Balance]


def parse_shares(shares: Any) -> tuple[Optional[tuple[float, ...]], Optional[Balance]]:
    """``(hand weights, balancer)`` from the ``shares`` option: None, a sequence of positive numbers
    (one per rank, proportions of B), ``"balanced"`` or a ``Balance``. ``ValueError`` otherwise."""
    accepted = "None, a list of positive numbers (one per rank: [3, 1]), 'balanced' or a Balance(...)"
    if shares is None:
        return None, None
    if isinstance(shares, Balance):
        return None, shares
    if isinstance(shares, str):
        if shares == "balanced":
            return None, Balance()
        raise ValueError(f"shares={shares!r} is not supported; accepted: {accepted}")
    if isinstance(shares, Sequence) and len(shares) > 0:
        ok = all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in shares)
        if ok and all(math.isfinite(s) and s > 0 for s in shares):
            return tuple(float(s) for s in shares), None
    raise ValueError(f"shares={shares!r} is not supported; accepted: {accepted}")


def round_shares(weights: Sequence[float], total: int, low: Sequence[int], high: Sequence[int]) -> list[int]:
    """Integers proportional to ``weights`` with sum ``total``, each within ``[low[i], high[i]]``:
    clipped proportional shares (water-filling), then largest remainder (ties to the lower rank)."""
    n = len(weights)
    if sum(low) > total or sum(high) < total:
        raise ValueError(
            f"{OWNER}: {n} ranks with shares in [{list(low)}, {list(high)}] cannot sum to the global batch {total}"
        )
    target = [0.0] * n
    free = list(range(n))
    left = float(total)
    while free:  # clip at the bounds, share the rest among the unclipped in proportion
        weight = sum(weights[i] for i in free)
        raw = {i: left * weights[i] / weight for i in free}
        clipped = [i for i in free if raw[i] < low[i] or raw[i] > high[i]]
        if not clipped:
            for i in free:
                target[i] = raw[i]
            break
        for i in clipped:
            target[i] = float(min(max(raw[i], low[i]), high[i]))
            left -= target[i]
        free = [i for i in free if i not in clipped]
    out = [min(max(math.floor(t), low[i]), high[i]) for i, t in enumerate(target)]
    order = sorted(range(n), key=lambda i: (-(target[i] - math.floor(target[i])), i))
    k = 0
    while sum(out) < total:  # each pass gives one sample to the next rank with room, by remainder
        i = order[k % n]
        if out[i] < high[i]:
            out[i] += 1
        k += 1
    while sum(out) > total:
        i = order[::-1][k % n]
        if out[i] > low[i]:
            out[i] -= 1
        k += 1
    return out


def hand_shares(weights: Sequence[float], total: int, accumulate: int) -> list[int]:
    """The shares of hand-set ``weights`` (proportions) of a global batch ``total``; every share at
    least ``accumulate`` (one sample per micro-batch)."""
    n = len(weights)
    return round_shares(weights, total, [accumulate] * n, [total] * n)


def share_bounds(balance: Balance, total: int, ranks: int, accumulate: int) -> tuple[list[int], list[int]]:
    """Each rank's least and most samples under ``balance``'s bounds."""
    uniform = total / ranks
    low = max(accumulate, math.ceil(balance.low * uniform - 1e-9))
    high = max(low, min(total, math.floor(balance.high * uniform + 1e-9)))
    return [low] * ranks, [high] * ranks


def balanced_shares(
    seconds_per_sample: Sequence[float],
    current: Sequence[int],
    balance: Balance,
    accumulate: int = 1,
) -> list[int]:
    """New shares from each rank's measured seconds per sample: proportional to speed, within
    ``balance``'s bounds, summing to ``sum(current)``; ``current`` when no share would move by more
    than ``balance.min_change`` of the global batch (and by at least one sample)."""
    total, ranks = sum(current), len(current)
    low, high = share_bounds(balance, total, ranks, accumulate)
    speeds = [1.0 / max(float(t), 1e-12) for t in seconds_per_sample]
    new = round_shares(speeds, total, low, high)
    moved = max(abs(a - b) for a, b in zip(new, current))
    return list(current) if moved < max(1.0, balance.min_change * total) else new


def rank_positions(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s samples among a step's ``sum(shares)`` positions."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def micro_sizes(share: int, accumulate: int) -> list[int]:
    """The sizes of a share's ``accumulate`` micro-batches (they differ by at most one)."""
    base, extra = divmod(share, accumulate)
    return [base + (1 if k < extra else 0) for k in range(accumulate)]


def loss_scale(world: int, accumulate: int, micro: int, total: int) -> float:
    """The factor on a micro-batch's mean loss: ``world * accumulate * micro / total``."""
    return world * accumulate * micro / total


@dataclass
class ShareSchedule:
    """The shares of every step: ``changes`` is ``[(first global step, shares), ...]`` in step order
    (what is left of it once earlier steps ran); plain ints, for checkpoints."""

    changes: list[tuple[int, list[int]]]

    def at(self, step: int) -> list[int]:
        """The shares of global optimizer step ``step``."""
        current = self.changes[0][1]
        for first, shares in self.changes:
            if first > step:
                break
            current = shares
        return current

    def add(self, first: int, shares: Sequence[int]) -> None:
        """``shares`` from step ``first`` on (a later change than those held)."""
        self.changes = [c for c in self.changes if c[0] < first] + [(first, list(shares))]

    def prune(self, done: int) -> None:
        """Forget what only steps before ``done`` used."""
        keep = [c for c in self.changes if c[0] <= done]
        self.changes = keep[-1:] + [c for c in self.changes if c[0] > done]

    def state_dict(self) -> list[list[Any]]:
        return [[first, list(shares)] for first, shares in self.changes]

    @classmethod
    def from_state(cls, state: Sequence[Sequence[Any]]) -> ShareSchedule:
        return cls([(int(first), [int(s) for s in shares]) for first, shares in state])
