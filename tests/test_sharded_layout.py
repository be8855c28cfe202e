"""The sharded layout part alone, in this process (no process group): its checks, its per-rank state
with another part's entry, and that state's round trip through a distributed checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dist.compression import make_compressor
from lightning_dist.layout.sharded_checkpoint import CHECKPOINT_KEY, ShardedCheckpoints
from lightning_dist.layout.sharded_layout import ShardedLayout
from lightning_dist.state import StateRegistry


def layout(
    replicas: int = 2, replica_sync: Any = "none", reduce_op: str = "avg", state: Any = None
) -> ShardedLayout:
    registry = StateRegistry() if state is None else state
    return ShardedLayout(replicas, None, 1024, False, replica_sync, reduce_op, registry)


def test_bad_replica_sync_and_world_sizes_are_refused_naming_what_is_accepted() -> None:
    with pytest.raises(
        ValueError, match="replica_sync='zip' is not known; accepted: none, .*Compressor instance"
    ):
        layout(replica_sync="zip")
    with pytest.raises(ValueError, match="reduce_op='adasum' is not supported with replica_sync='int8'"):
        layout(replica_sync="int8", reduce_op="adasum")
    with pytest.raises(ValueError, match="replicas=2 must divide the world size 3 .*accepted: 1, 3"):
        layout().check(3)
    sync = make_compressor("fp16")
    assert layout(replica_sync=sync, reduce_op="adasum").replica_sync is sync


def test_no_replica_hook_with_one_replica_group_or_without_replica_gradients() -> None:
    assert layout(replicas=1).replica_hook(None, 0) is None  # type: ignore[arg-type]
    part = layout()
    part.replica_gradients = False
    assert part.replica_hook(None, 0) is None  # type: ignore[arg-type]


def test_another_parts_entry_is_saved_while_held_and_loaded_back() -> None:
    """The layout's pieces and another part's share the strategy's registry (one per-rank entry)."""
    registry = StateRegistry()
    layout(state=registry)
    mine = {"momentum": torch.arange(3.0)}
    loaded: list[Any] = []
    registry.register(
        "mine",
        lambda c: mine,
        per_rank=True,
        active=lambda: bool(mine),
        load=loaded.append,
        words=("my momentum",),
    )
    assert registry.words() == [
        "error-feedback residuals",
        "replica-sync compressor state",
        "my momentum",
    ]
    assert registry.held()
    state = registry.own({})
    assert list(state) == ["mine"] and state["mine"] is mine, "empty layout state is not saved"
    assert registry.load({**state, "other": 1}) == ["other"], "another strategy's piece is left out"
    assert loaded == [mine]
    mine.clear()
    assert not registry.held() and "mine" not in registry.own({})


def test_the_rank_state_round_trips_through_the_distributed_checkpoint(tmp_path: Path) -> None:
    """Model and optimizer entries move into DCP files; this rank's state is read back alone."""
    model = torch.nn.Linear(3, 2)
    checkpoint: dict[str, Any] = {"state_dict": model.state_dict(), "optimizer_states": [], "epoch": 1}
    state = {"replica_sync": {"keys": {}}, "residuals": {"0": torch.randn(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... a single process"
        ShardedCheckpoints().save(checkpoint, tmp_path, 1, state, background=True)
        back = ShardedCheckpoints.load_rank_state(tmp_path, 1)
    assert checkpoint == {"epoch": 1}, "the metadata is what is left"
    assert back["replica_sync"] == state["replica_sync"]
    assert torch.equal(back["residuals"]["0"], state["residuals"]["0"])
    assert CHECKPOINT_KEY == "lightning_dist.sharded"
