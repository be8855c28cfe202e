"""HorovodAdasum checkpoints hold every rank's optimizer state, and a resumed run loads its own rank's.

Each rank's optimizer steps on its own gradients, so Adam's moments differ between ranks; a checkpoint
with rank 0's state alone resumes to other weights than the uninterrupted run. The unit tests use a
stand-in backend (no processes); the slow test resumes 2-rank runs under mpirun.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MPIRUN_TWO_RANKS, assert_same_weights, load_rank, max_abs_diff, run_in_sequence
from torch import nn

from lightning_dist.collectives import Communicator
from lightning_dist.strategies.horovod_adasum import CHECKPOINT_KEY, HorovodAdasum
from lightning_dist.testing import run_in_threads

# -- unit level: a stand-in backend, no processes ---------------------------------------------------


class FakeBackend:
    """What HorovodAdasum reads of its backend to load a checkpoint (no collectives)."""

    name = "fake"

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.local_rank, self.node_rank, self.local_size = (
            rank,
            world_size,
            rank,
            0,
            world_size,
        )


def adamw_state(seed: int) -> dict[str, Any]:
    """The state dict of an AdamW on a fixed Linear after one step on gradients drawn from ``seed``."""
    opt = make_optimizer()
    gen = torch.Generator().manual_seed(seed)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt.state_dict()


def make_optimizer() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    return torch.optim.AdamW(nn.Linear(3, 2).parameters(), lr=1e-2)


def strategy_on(backend: Any) -> HorovodAdasum:
    strategy = HorovodAdasum()
    strategy._backend = backend  # type: ignore[assignment]
    strategy.optimizers = [make_optimizer()]
    return strategy


def exp_avgs(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s["exp_avg"] for s in opt.state_dict()["state"].values()]


def assert_state_is(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    expected = [s["exp_avg"] for s in state["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avgs(opt), expected, strict=True))


def test_each_rank_loads_its_own_optimizer_state() -> None:
    s0, s1 = adamw_state(0), adamw_state(1)
    checkpoint = {"optimizer_states": [s0], CHECKPOINT_KEY: {"world_size": 2, "ranks": [[s0], [s1]]}}
    for rank, expected in ((0, s0), (1, s1)):
        strategy = strategy_on(FakeBackend(rank, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy.load_optimizer_state_dict(checkpoint)
        assert_state_is(strategy.optimizers[0], expected)


@pytest.mark.parametrize(
    "entry, says",
    [
        (None, "no per-rank optimizer states"),
        ("world4", "saved at world size 4, this run has 2"),
    ],
)
def test_old_or_other_world_size_checkpoint_warns_and_loads_rank0_state(entry: Any, says: str) -> None:
    s0, s1 = adamw_state(0), adamw_state(1)
    checkpoint: dict[str, Any] = {"optimizer_states": [s0]}
    if entry == "world4":
        checkpoint[CHECKPOINT_KEY] = {"world_size": 4, "ranks": [[s0], [s1], [s1], [s1]]}
    strategy = strategy_on(FakeBackend(1, 2))
    with pytest.warns(UserWarning, match="every rank loads rank 0's optimizer state") as record:
        strategy.load_optimizer_state_dict(checkpoint)
    assert says in str(record[0].message)
    assert_state_is(strategy.optimizers[0], s0)


def save_on_two_ranks(tmp_path: Path, checkpoints: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each rank's strategy (on a thread with a real Gloo group) saves ``checkpoints[rank]`` to
    ``tmp_path/rank{r}.ckpt``; returns each rank's collective counters."""

    def body(comm: Communicator) -> dict[str, float]:
        strategy = strategy_on(comm.backend)
        strategy.rank_state_comm = lambda: comm  # type: ignore[method-assign]  # count on this rank's stats
        strategy.save_checkpoint(checkpoints[comm.rank], tmp_path / f"rank{comm.rank}.ckpt")
        return {k: v for k, v in comm.stats.snapshot().items() if k.endswith(".calls") and v}

    return run_in_threads(2, body)


def test_save_gathers_every_rank_state_on_cpu_in_one_collective(tmp_path: Path) -> None:
    """Rank 0 writes both ranks' states, gathered in one all-to-all; the other rank writes nothing."""
    states = [adamw_state(0), adamw_state(1)]
    calls = save_on_two_ranks(tmp_path, [{"optimizer_states": [s], "state_dict": {}} for s in states])
    assert calls == [{"all_to_all.calls": 2}] * 2, "one all-to-all and its row-count exchange"
    assert not (tmp_path / "rank1.ckpt").exists()
    saved = torch.load(tmp_path / "rank0.ckpt", weights_only=False)[CHECKPOINT_KEY]
    assert saved["world_size"] == 2
    for got, want in zip(saved["ranks"], states, strict=True):
        assert [s["exp_avg"].device.type for s in got[0]["state"].values()] == ["cpu", "cpu"]
        assert all(
            torch.equal(a["exp_avg"], b["exp_avg"])
            for a, b in zip(got[0]["state"].values(), want["state"].values(), strict=True)
        )


def test_weights_only_checkpoint_gathers_nothing(tmp_path: Path) -> None:
    assert save_on_two_ranks(tmp_path, [{"state_dict": {}}] * 2) == [{}, {}]
    assert CHECKPOINT_KEY not in torch.load(tmp_path / "rank0.ckpt", weights_only=False)


def test_without_setup_the_gather_goes_through_the_strategy_backend() -> None:
    """A checkpoint written by a strategy that was not set up in this process (no communicator made
    yet): the gather goes through a communicator over the strategy's own backend."""
    backend = FakeBackend(0, 2)
    strategy = strategy_on(backend)
    assert strategy.communicator is None
    assert strategy.rank_state_comm().backend is backend


# -- 2 ranks under mpirun ---------------------------------------------------------------------------


def mpirun_resume(*runs: list[str]) -> None:
    """``runs`` (hvd_resume.py's flags each), one after another in one ``mpirun -np 2`` launch."""
    run_in_sequence([["hvd_resume.py", *args] for args in runs], 200, [*MPIRUN_TWO_RANKS, sys.executable])


def optimizer_state(out: Path, rank: int) -> dict[str, torch.Tensor]:
    state = torch.load(out / f"rank{rank}_opt.pt")
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items()}


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.timeout(420)
def test_resumed_run_ends_on_the_uninterrupted_run_weights(tmp_path: Path) -> None:
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    a, b1, b2, old = (tmp_path / n for n in ("a", "b1", "b2", "old"))
    ckpt = b1 / "epoch=0-step=4.ckpt"
    mpirun_resume(
        ["--max-steps", "8", "--out", str(a)],
        # first half: ModelCheckpoint at step 4 (inside fit) and trainer.save_checkpoint after fit
        ["--max-steps", "4", "--save-every", "4", "--save", str(tmp_path / "post.ckpt"), "--out", str(b1)],
        ["--max-steps", "8", "--resume", str(ckpt), "--out", str(b2)],
        # an old checkpoint (no per-rank states): the step-4 checkpoint without HorovodAdasum's entry
        ["--max-steps", "8", "--resume", str(ckpt), "--drop-entry", "--out", str(old)],
    )

    for r in (0, 1):
        wa, info_a = load_rank(a, r)
        wb, info_b = load_rank(b2, r)
        assert info_b["global_step"] == 8 and info_b["warnings"] == []
        assert info_b["batches"] == info_a["batches"][4:], "the resumed run sees the same data"
        diff = max_abs_diff(wa, wb)
        assert diff == 0, f"rank {r}: resumed weights differ from the uninterrupted run's by up to {diff:.3g}"
        assert_same_weights(optimizer_state(a, r), optimizer_state(b2, r), atol=0)  # bitwise

    assert max_abs_diff(optimizer_state(a, 0), optimizer_state(a, 1)) > 1e-4, "ranks' Adam states differ"
    saved = torch.load(ckpt, weights_only=False)
    post = torch.load(tmp_path / "post.ckpt", weights_only=False)  # gathered after fit's teardown
    assert saved[CHECKPOINT_KEY]["world_size"] == 2 and len(saved[CHECKPOINT_KEY]["ranks"]) == 2
    for r in (0, 1):
        x, y = saved[CHECKPOINT_KEY]["ranks"][r][0]["state"], post[CHECKPOINT_KEY]["ranks"][r][0]["state"]
        assert all(torch.equal(x[i][k], y[i][k]) for i in x for k in x[i])

    # the old checkpoint (no per-rank states): warns, every rank resumes from rank 0's state, and ends
    # elsewhere (what every resume did before the per-rank states were kept: 9.3e-3 here)
    for r in (0, 1):
        wa, _ = load_rank(a, r)
        wo, info_o = load_rank(old, r)
        # the same on every rank, so shown once, by rank 0 (lightning_dist.warn.warn_once)
        assert len(info_o["warnings"]) == (1 if r == 0 else 0), info_o["warnings"]
        assert r != 0 or "rank 0's optimizer state" in info_o["warnings"][0]
        assert max_abs_diff(wa, wo) > 1e-4
