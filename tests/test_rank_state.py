"""The per-rank checkpoint state helper (``lightning_dist.strategies.rank_state``): every rank's state
gathered to rank 0 in one collective whatever the world size (threads with real Gloo groups, the
calls counted by each rank's communicator), each rank picking its own entry on load, and a checkpoint
without the entry or from another world size falling back with exactly one warning."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_dist.collectives import Communicator, SingleProcessBackend
from lightning_dist.state import RankStates
from lightning_dist.strategies.rank_state import RankStateMixin, gather_objects
from lightning_dist.testing import run_in_threads
from lightning_dist.warn import RANK_VARIABLES

STATES = RankStates("test.key", "Owner", "the checkpoint has no test state")


def rank_object(rank: int) -> dict[str, Any]:
    """A state of a size that differs per rank, with a tensor (pickled as torch does)."""
    gen = torch.Generator().manual_seed(rank)
    return {"rank": rank, "residual": torch.randn(3 + rank, generator=gen), "names": ["x"] * rank}


def collective_calls(snapshot: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in snapshot.items() if k.endswith(".calls") and v}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gather_is_one_collective_to_rank_zero(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[Any, dict[str, float]]:
        return gather_objects(comm, rank_object(comm.rank)), comm.stats.snapshot()

    results = run_in_threads(world_size, body)
    gathered, root_stats = results[0]
    assert [g["rank"] for g in gathered] == list(range(world_size))
    for r, g in enumerate(gathered):
        want = rank_object(r)
        assert torch.equal(g["residual"], want["residual"]) and g["names"] == want["names"]
    assert all(got is None for got, _ in results[1:]), "only rank 0 holds the others' states"
    for _, stats in results:
        # one all-to-all and the row-count exchange it starts with, at every world size (W broadcasts before)
        assert collective_calls(stats) == {"all_to_all.calls": 2}
    sent = [stats["all_to_all.bytes_sent"] - (world_size - 1) * 8 for _, stats in results]
    assert sent[0] == 0 and min(sent[1:]) > 0, "rank 0 sends nothing, each other rank its state"
    assert root_stats["all_to_all.bytes_received"] == sum(sent) + (world_size - 1) * 8


def test_gather_sends_each_pickled_state_once_to_rank_zero() -> None:
    def body(comm: Communicator) -> dict[str, float]:
        gather_objects(comm, ["x" * (100 * comm.rank)])
        return comm.stats.snapshot()

    results = run_in_threads(3, body)
    sizes = [len(pickle.dumps(["x" * (100 * r)])) for r in range(3)]
    assert [s["all_to_all.bytes_sent"] for s in results] == [16, sizes[1] + 16, sizes[2] + 16]
    assert results[0]["all_to_all.bytes_received"] == sizes[1] + sizes[2] + 16


def test_gather_on_one_rank_is_the_object_itself() -> None:
    obj = rank_object(0)
    comm = Communicator(SingleProcessBackend())
    assert gather_objects(comm, obj) == [obj] and comm.stats.snapshot()["calls"] == 0


class _Layer(RankStateMixin, SingleDeviceStrategy):
    """A strategy with two contributors of per-rank state, as ``ElasticDiLoCo`` stacks two."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(device=torch.device("cpu"))
        self.comm = comm

    def rank_state_comm(self) -> Communicator:
        return self.comm

    def rank_state(self, checkpoint: Any) -> dict[str, Any]:
        return {**super().rank_state(checkpoint), "a": self.comm.rank}

    def rank_state_entries(self, ranks: list[dict[str, Any]], checkpoint: Any) -> dict[str, Any]:
        entry = STATES.entry([r["a"] for r in ranks], len(ranks), note="a")
        return {**super().rank_state_entries(ranks, checkpoint), **entry}


class _Stacked(_Layer):
    def rank_state(self, checkpoint: Any) -> dict[str, Any]:
        return {**super().rank_state(checkpoint), "b": 10 * self.comm.rank}

    def rank_state_entries(self, ranks: list[dict[str, Any]], checkpoint: Any) -> dict[str, Any]:
        return {**super().rank_state_entries(ranks, checkpoint), "other": [r["b"] for r in ranks]}


def test_stacked_contributors_share_one_gather_and_rank_zero_gets_the_entries() -> None:
    def body(comm: Communicator) -> tuple[dict[str, Any], dict[str, float]]:
        return _Stacked(comm).with_rank_states({"state_dict": {}}), comm.stats.snapshot()

    results = run_in_threads(3, body)
    root, root_stats = results[0]
    assert root["test.key"] == {"world_size": 3, "note": "a", "ranks": [0, 1, 2]}
    assert root["other"] == [0, 10, 20] and root["state_dict"] == {}
    for checkpoint, stats in results[1:]:
        assert checkpoint == {"state_dict": {}}, "the other ranks' checkpoints are left as they were"
        assert collective_calls(stats) == {"all_to_all.calls": 2}
    assert collective_calls(root_stats) == {"all_to_all.calls": 2}


# -- on load: own entry, or the fallback with exactly one warning -----------------------------------
@pytest.fixture
def rank_zero(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield


def select(saved: Any, rank: int, world_size: int) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        own = STATES.select(saved, rank, world_size, fallback="the state is reset")
    return own, [str(w.message) for w in caught]


def test_each_rank_picks_its_own_entry_without_a_warning(rank_zero: None) -> None:
    saved = STATES.entry(["s0", "s1", "s2"], 3)["test.key"]
    assert [select(saved, r, 3) for r in range(3)] == [("s0", []), ("s1", []), ("s2", [])]


@pytest.mark.parametrize(
    ("saved", "says"),
    [
        (None, "Owner: the checkpoint has no test state; the state is reset"),
        (
            {"world_size": 2, "ranks": ["s0", "s1"]},
            "Owner: the checkpoint was saved at world size 2, this run has 3; the state is reset",
        ),
        (
            {"world_size": 3, "ranks": ["s0", "s1"]},  # a damaged entry: fewer states than ranks
            "Owner: the checkpoint was saved at world size 3, this run has 3; the state is reset",
        ),
    ],
    ids=["missing", "other_world_size", "short"],
)
def test_fallback_warns_exactly_once_saying_what_is_reset(
    rank_zero: None, monkeypatch: pytest.MonkeyPatch, saved: Any, says: str
) -> None:
    assert select(saved, 0, 3) == (None, [says])
    monkeypatch.setenv("RANK", "2")
    assert select(saved, 2, 3) == (None, []), "the same on every rank: rank 0 says it"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert STATES.select(saved, 2, 3, "reset", warn=False) is None
    assert caught == []
