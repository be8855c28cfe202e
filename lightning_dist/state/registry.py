"""``StateRegistry``: every piece of a strategy's training state, registered once by name.

    state = StateRegistry()
    state.register("compressor", self.compressor_piece, per_rank=True,
                   checkpoint=COMPRESSOR_STATES, fields=self.compressor_fields)
    own = state.own(checkpoint)                      # this rank's per-rank pieces, by name
    entries = state.entries(every_ranks_own, world)  # on rank 0: one checkpoint entry per piece

A piece is *per rank* (it differs between ranks: residuals, local weights, RNG) or *replicated*
(equal on every rank: DiLoCo's outer state), and has a ``save`` that reads it, given the
checkpoint Lightning dumped (its weights and optimizer states, when a piece needs them). A piece
that has nothing to save right now (before ``setup``, outside a commit) says so with ``active``.
Register bound methods, not lambdas: a strategy is pickled when Lightning spawns its processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_dist.state.entries import RankStates

__all__ = ["StateEntry", "StateRegistry"]

Save = Callable[[Mapping[str, Any]], Any]


def always() -> bool:
    """``active`` of a piece that always has state (a module-level function: strategies pickle)."""
    return True


@dataclass(frozen=True)
class StateEntry:
    """One named piece of training state.

    Args:
        name: unique within the registry; the key of this piece in a rank's saved dict.
        save: this piece now (picklable, CPU tensors), given the checkpoint Lightning dumped.
        per_rank: it differs between ranks (saved once per rank), else it is replicated.
        checkpoint: where Lightning's gathered checkpoint keeps it (None: not in that checkpoint).
        fields: extra fields of its checkpoint entry (``{"compressor": "int8"}``), read at save time.
        active: whether the piece has state to save now (state a resume would otherwise lose).
        load: restores what ``save`` returned (the savers that hand a rank its own pieces back: the
            distributed checkpoint's per-rank entry); None where the strategy loads it itself.
        words: what it holds, in words, for the warning of a resume that drops it.
    """

    name: str
    save: Save
    per_rank: bool
    checkpoint: Optional[RankStates] = None
    fields: Callable[[], Mapping[str, Any]] = dict
    active: Callable[[], bool] = always
    load: Optional[Callable[[Any], None]] = None
    words: tuple[str, ...] = ()


@dataclass
class StateRegistry:
    """The pieces of one strategy's training state, in registration order (the order savers use)."""

    pieces: dict[str, StateEntry] = field(default_factory=dict)

    def register(
        self,
        name: str,
        save: Save,
        *,
        per_rank: bool,
        checkpoint: Optional[RankStates] = None,
        fields: Optional[Callable[[], Mapping[str, Any]]] = None,
        active: Optional[Callable[[], bool]] = None,
        load: Optional[Callable[[Any], None]] = None,
        words: tuple[str, ...] = (),
    ) -> None:
        """Add a piece; a name registered twice is a programming error (two parts claiming one name)."""
        if name in self.pieces:
            raise ValueError(f"StateRegistry: {name!r} is registered already; every piece has one name")
        self.pieces[name] = StateEntry(
            name, save, per_rank, checkpoint, fields or dict, active or always, load, words
        )

    def names(self, *, per_rank: Optional[bool] = None) -> list[str]:
        """The registered names (only per-rank or only replicated ones when ``per_rank`` is given)."""
        return [n for n, p in self.pieces.items() if per_rank is None or p.per_rank == per_rank]

    def own(self, checkpoint: Mapping[str, Any], *, per_rank: bool = True) -> dict[str, Any]:
        """This rank's active pieces (per-rank ones by default), by name."""
        return {
            n: p.save(checkpoint) for n, p in self.pieces.items() if p.per_rank == per_rank and p.active()
        }

    def held(self) -> bool:
        """Whether this rank holds per-rank state now (a gathered-only save would have to keep it)."""
        return any(p.per_rank and p.active() for p in self.pieces.values())

    def words(self) -> list[str]:
        """What the per-rank pieces hold, in words."""
        return [w for p in self.pieces.values() if p.per_rank for w in p.words]

    def load(self, saved: Mapping[str, Any]) -> list[str]:
        """Hand each piece in ``saved`` (what ``own`` returned on this rank) back to its ``load``;
        returns the names no piece here loads (state of another strategy), which are left out."""
        left = []
        for name, value in saved.items():
            piece = self.pieces.get(name)
            if piece is None or piece.load is None:
                left.append(name)
            else:
                piece.load(value)
        return left

    def entries(self, ranks: Sequence[Mapping[str, Any]], world_size: int) -> dict[str, Any]:
        """On the gathering rank: one Lightning checkpoint entry per piece saved by every rank
        (``ranks``: each rank's ``own``), under that piece's ``checkpoint`` key."""
        out: dict[str, Any] = {}
        for name, piece in self.pieces.items():
            if piece.checkpoint is None or not ranks or name not in ranks[0]:
                continue
            out.update(piece.checkpoint.entry([r[name] for r in ranks], world_size, **piece.fields()))
        return out
