"""How a per-rank piece of state sits in a Lightning checkpoint: one entry under its key holding
every rank's part, ``{"world_size": W, ...fields, "ranks": [rank r's part for r < W]}``, and the
rules a resume follows when the entry is missing or from another world size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_dist.warn import warn_once

__all__ = ["RankStates"]


@dataclass(frozen=True)
class RankStates:
    """A checkpoint entry under ``key`` holding every rank's state, and its rules on load.

    Args:
        key: the checkpoint's key (``"lightning_dist.compressed"``).
        owner: who warns (``"Compressed"``): the warning starts with it.
        missing: the problem when a checkpoint lacks the entry (``"the checkpoint has no ..."``).
    """

    key: str
    owner: str
    missing: str

    def entry(self, ranks: Sequence[Any], world_size: int, **fields: Any) -> dict[str, Any]:
        """``{key: {"world_size": W, **fields, "ranks": [...]}}`` for rank 0's checkpoint."""
        return {self.key: {"world_size": world_size, **fields, "ranks": list(ranks)}}

    def problem(self, saved: Optional[Mapping[str, Any]], world_size: int) -> Optional[str]:
        """Why this run cannot take its own rank's state from ``saved`` (the entry), or None."""
        if saved is None:
            return self.missing
        if saved.get("world_size") != world_size or len(saved.get("ranks", ())) != world_size:
            return (
                f"the checkpoint was saved at world size {saved.get('world_size')}, this run has {world_size}"
            )
        return None

    def select(
        self,
        saved: Optional[Mapping[str, Any]],
        rank: int,
        world_size: int,
        fallback: str,
        warn: bool = True,
        stacklevel: int = 2,
    ) -> Optional[Any]:
        """Rank ``rank``'s state from ``saved``; or, when ``problem`` says it has none for this run,
        ``None`` after one warning ``"<owner>: <problem>; <fallback>"`` (shown once, by rank 0: every
        rank meets the same problem). ``fallback`` says what the strategy does instead: what is
        dropped or reset; ``warn=False`` where that loses nothing. ``stacklevel`` counts from the
        caller, as ``warnings.warn``'s."""
        problem = self.problem(saved, world_size)
        if problem is None:
            assert saved is not None
            return saved["ranks"][rank]
        if warn:
            warn_once(f"{self.owner}: {problem}; {fallback}", stacklevel=stacklevel + 1)
        return None
