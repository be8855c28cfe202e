"""The training-state registry (``lightning_dist.state``): each piece named once, per rank or
replicated, saved in registration order, gathered into one Lightning checkpoint entry per piece
with the same layout ``RankStates`` reads back; a strategy holding it still pickles (spawn)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from lightning_dist import Compressed
from lightning_dist.state import RankStates, StateRegistry

RESIDUALS = RankStates("test.residuals", "Test", "the checkpoint has no residuals")


class _Part:
    """A part holding per-rank and replicated state, registered by bound methods."""

    def __init__(self, rank: int, registry: StateRegistry) -> None:
        self.rank, self.ready = rank, False
        registry.register(
            "residuals",
            self.residuals,
            per_rank=True,
            checkpoint=RESIDUALS,
            fields=self.fields,
            active=self.is_ready,
        )
        registry.register("outer", self.outer, per_rank=False)

    def residuals(self, checkpoint: Any) -> list[int]:
        return [self.rank, len(checkpoint["state_dict"])]

    def outer(self, checkpoint: Any) -> dict[str, int]:
        return {"momentum": 7}

    def fields(self) -> dict[str, str]:
        return {"kind": "int8"}

    def is_ready(self) -> bool:
        return self.ready


def test_pieces_are_saved_by_scope_and_only_while_active() -> None:
    registry = StateRegistry()
    part = _Part(1, registry)
    checkpoint = {"state_dict": {"w": 0, "b": 1}}
    assert registry.names() == ["residuals", "outer"]
    assert registry.names(per_rank=True) == ["residuals"] and registry.names(per_rank=False) == ["outer"]
    assert registry.own(checkpoint) == {}, "an inactive piece saves nothing"
    part.ready = True
    assert registry.own(checkpoint) == {"residuals": [1, 2]}
    assert registry.own(checkpoint, per_rank=False) == {"outer": {"momentum": 7}}


def test_entries_round_trip_through_rank_states() -> None:
    registries = [StateRegistry() for _ in range(3)]
    parts = [_Part(r, reg) for r, reg in enumerate(registries)]
    for p in parts:
        p.ready = True
    checkpoint = {"state_dict": {"w": 0}}
    ranks = [reg.own(checkpoint) for reg in registries]
    entries = registries[0].entries(ranks, world_size=3)
    assert entries == {"test.residuals": {"world_size": 3, "kind": "int8", "ranks": [[0, 1], [1, 1], [2, 1]]}}
    for r in range(3):
        assert RESIDUALS.select(entries["test.residuals"], r, 3, fallback="-") == [r, 1]
    with pytest.warns(UserWarning, match="saved at world size 3, this run has 2; starts afresh"):
        assert RESIDUALS.select(entries["test.residuals"], 0, 2, fallback="starts afresh") is None


def test_a_name_is_registered_once() -> None:
    registry = StateRegistry()
    _Part(0, registry)
    with pytest.raises(ValueError, match="'outer' is registered already"):
        registry.register("outer", lambda c: None, per_rank=False)


def test_a_strategy_with_registered_state_pickles_and_keeps_its_pieces() -> None:
    strategy = Compressed("int8")
    assert strategy.training_state.names(per_rank=True) == ["compressor"]
    clone = pickle.loads(pickle.dumps(strategy))  # Lightning's spawn launcher pickles the strategy
    piece = clone.training_state.pieces["compressor"]
    assert piece.fields() == {"compressor": "int8"}
    assert piece.save.__self__ is clone  # type: ignore[attr-defined]
