"""Streaming DiLoCo's fragments and schedule, pure (no transport).

The parameters (in their fixed order) are cut into ``fragments`` contiguous runs balanced by numel.
With ``inner_steps`` H and P fragments one fragment syncs every H/P inner steps, in turn (fragment
0 first, at step H/P; fragment f at steps (f + 1) H/P + k H), as torchft's ``DiLoCo`` with
``model_fragments``; its pseudo-gradient is taken and sent ``fragment_sync_delay`` (tau) steps
before and lands (outer step, mixing) at that step.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_fragments(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of ``numels`` cut into ``fragments`` contiguous, non-empty runs: cut k sits at the
    parameter boundary nearest to k/P of the total (ties to the earlier), so each run is within one
    parameter of an equal share. ValueError when there are fewer parameters than fragments."""
    n = len(numels)
    if fragments > n:
        raise ValueError(
            f"fragments={fragments} is more than the {n} parameters the inner optimizer steps; "
            f"accepted: an integer from 1 to {n}"
        )
    total = sum(numels)
    prefix = [0]
    for k in numels:
        prefix.append(prefix[-1] + k)
    cuts = [0]
    for k in range(1, fragments):
        target = total * k / fragments
        low, high = cuts[-1] + 1, n - (fragments - k)  # leave a parameter for each later run
        best = min(range(low, high + 1), key=lambda c: (abs(prefix[c] - target), c))
        cuts.append(best)
    cuts.append(n)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


class FragmentSchedule:
    """When a fragment's exchange starts and lands: ``every`` = inner_steps / fragments steps apart."""

    def __init__(self, inner_steps: int, fragments: int, delay: int) -> None:
        self.every = inner_steps // fragments
        self.fragments = fragments
        self.delay = delay

    def starts(self, step: int) -> bool:
        """Whether the overlapped exchange starts after inner step ``step`` of the cadence (1-based)."""
        return self.delay > 0 and step == self.every - self.delay

    def lands(self, step: int) -> bool:
        """Whether a fragment syncs (or its exchange lands) after inner step ``step`` of the cadence."""
        return step >= self.every
