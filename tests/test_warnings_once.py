"""A warning every rank would raise alike is shown once, by global rank zero (``lightning_dist.warn``),
and once per message and place in a process. Fast, one process: the rank comes from a monkeypatched
environment (or a one-rank Gloo group made from a HashStore)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.elastic import CommitStore, CommitWarning, ElasticBatchWarning, ElasticPlan
from lightning_dist.strategies.diloco import DiLoCo
from lightning_dist.warn import RANK_VARIABLES, global_rank, warn_once


@pytest.fixture(autouse=True)
def no_rank_in_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield


def shown(call: Callable[[], Any], action: str = "default") -> list[warnings.WarningMessage]:
    """The warnings ``call`` shows under the filter ``action`` (Python's default one: "default")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        call()
    return caught


# -- the helper -----------------------------------------------------------------------------------
def test_warns_on_rank_zero_and_not_on_rank_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [str(w.message) for w in shown(lambda: warn_once("on rank zero"))] == ["on rank zero"]
    monkeypatch.setenv("RANK", "0")
    assert len(shown(lambda: warn_once("RANK=0"))) == 1
    monkeypatch.setenv("RANK", "1")
    assert shown(lambda: warn_once("RANK=1"), "always") == []


@pytest.mark.parametrize("name", RANK_VARIABLES)
def test_each_launchers_rank_variable_is_read(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "3")
    assert global_rank() == 3
    assert shown(lambda: warn_once(f"{name}=3"), "always") == []


def test_rank_variables_are_read_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's RANK before srun's SLURM_PROCID (one srun task may run a torchrun of 8 ranks)."""
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("RANK", "0")
    assert global_rank() == 0 and len(shown(lambda: warn_once("RANK first"))) == 1


def test_torch_distributed_rank_wins_once_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "5")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert global_rank() == 0
        assert len(shown(lambda: warn_once("the group's rank 0"))) == 1
    finally:
        dist.destroy_process_group()
    assert global_rank() == 5


def test_identical_messages_are_shown_once() -> None:
    def twice() -> None:
        for text in ("same", "same", "other"):
            warn_once(text, RuntimeWarning)

    assert [(str(w.message), w.category) for w in shown(twice)] == [
        ("same", RuntimeWarning),
        ("other", RuntimeWarning),
    ]
    assert len(shown(twice, "always")) == 3, "an 'always' filter (pytest.warns) shows every call"
    with pytest.raises(RuntimeWarning, match="same"):
        shown(twice, "error")


def test_stacklevel_counts_as_warnings_warn() -> None:
    def library_call() -> None:
        warn_once("blame the caller", stacklevel=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        library_call()
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


# -- call sites that go through it ----------------------------------------------------------------
def diloco_resume_without_its_entry() -> None:
    """A DiLoCo resumed from a checkpoint another strategy saved: warns on every rank before."""
    module = nn.Linear(3, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    strategy = DiLoCo(inner_steps=2, parallel_devices=[torch.device("cpu")])
    strategy.optimizers = [opt]
    strategy.load_optimizer_state_dict({"optimizer_states": [opt.state_dict()]})


@pytest.mark.parametrize(
    ("call", "category", "says"),
    [
        (diloco_resume_without_its_entry, UserWarning, "DiLoCo: the checkpoint has no DiLoCo state"),
        (
            lambda: ElasticPlan(
                dataset_len=1000, global_batch=96, world_size=4, micro_batch=32
            ).for_world_size(5),
            ElasticBatchWarning,
            "global_batch=96 is not divisible by world_size=5",
        ),
    ],
    ids=["diloco", "elastic_plan"],
)
def test_call_sites_warn_on_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, call: Callable[[], Any], category: type[Warning], says: str
) -> None:
    caught = shown(call, "always")
    assert [w.category for w in caught] == [category] and says in str(caught[0].message)
    for rank in ("1", "3"):
        monkeypatch.setenv("RANK", rank)
        assert shown(call, "always") == [], f"rank {rank} warned"


def test_a_damaged_commit_is_reported_by_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = CommitStore(tmp_path)
    for step in (1, 2):
        store.save(step, {"step": step})
    store.path(2).write_bytes(b"damaged")

    caught = shown(store.load_latest, "always")
    assert [w.category for w in caught] == [CommitWarning] and "skipping commit" in str(caught[0].message)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    commit = None

    def load() -> None:
        nonlocal commit
        commit = store.load_latest()

    assert shown(load, "always") == [] and commit is not None and commit.step == 1


def test_lightning_launcher_children_are_not_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist.warn import RANK_VARIABLES, global_rank

    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert global_rank() != 0, "a child Lightning started (only LOCAL_RANK set) does not warn"
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("NODE_RANK", "2")
    assert global_rank() != 0
    monkeypatch.setenv("NODE_RANK", "0")
    assert global_rank() == 0
