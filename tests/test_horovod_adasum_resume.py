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
from helpers import SCRIPTS, assert_same_weights, load_rank, max_abs_diff, run_command
from torch import nn

from lightning_dist.strategies.horovod_adasum import CHECKPOINT_KEY, HorovodAdasum

# -- unit level: a stand-in backend, no processes ---------------------------------------------------


class FakeBackend:
    """What HorovodAdasum reads of its backend; ``broadcast_object`` from rank r returns ``sent[r]``."""

    name = "fake"

    def __init__(self, rank: int, world_size: int, sent: dict[int, Any] | None = None) -> None:
        self.rank, self.world_size, self.local_rank, self.node_rank, self.local_size = (
            rank,
            world_size,
            rank,
            0,
            world_size,
        )
        self.sent = sent or {}
        self.broadcasts: list[tuple[Any, int]] = []

    def broadcast_object(self, obj: Any, src: int) -> Any:
        self.broadcasts.append((obj, src))
        return obj if src == self.rank else self.sent[src]


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


def strategy_on(backend: FakeBackend) -> HorovodAdasum:
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


def test_save_gathers_every_rank_state_on_cpu(tmp_path: Path) -> None:
    """Rank 0 writes both ranks' states; with no communicator made yet (no setup ran), the gather goes
    through one the strategy makes from its own backend."""
    s0, s1 = adamw_state(0), adamw_state(1)
    backend = FakeBackend(0, 2, sent={1: [s1]})
    strategy = strategy_on(backend)
    assert strategy.communicator is None
    path = tmp_path / "x.ckpt"
    strategy.save_checkpoint({"optimizer_states": [s0], "state_dict": {}}, path)
    assert [src for _, src in backend.broadcasts] == [1], "one broadcast, from rank 1"
    saved = torch.load(path, weights_only=False)[CHECKPOINT_KEY]
    assert saved["world_size"] == 2
    for got, want in zip(saved["ranks"], (s0, s1), strict=True):
        assert [s["exp_avg"].device.type for s in got[0]["state"].values()] == ["cpu", "cpu"]
        assert all(
            torch.equal(a["exp_avg"], b["exp_avg"])
            for a, b in zip(got[0]["state"].values(), want["state"].values(), strict=True)
        )


def test_save_on_other_ranks_sends_own_state_and_writes_nothing(tmp_path: Path) -> None:
    s1 = adamw_state(1)
    backend = FakeBackend(1, 2)
    strategy = strategy_on(backend)
    path = tmp_path / "x.ckpt"
    strategy.save_checkpoint({"optimizer_states": [s1], "state_dict": {}}, path)
    ((sent, src),) = backend.broadcasts
    assert src == 1 and torch.equal(sent[0]["state"][0]["exp_avg"], s1["state"][0]["exp_avg"])
    assert not path.exists()


def test_weights_only_checkpoint_gathers_nothing(tmp_path: Path) -> None:
    backend = FakeBackend(0, 2)
    strategy_on(backend).save_checkpoint({"state_dict": {}}, tmp_path / "w.ckpt")
    assert backend.broadcasts == []
    assert CHECKPOINT_KEY not in torch.load(tmp_path / "w.ckpt", weights_only=False)


# -- 2 ranks under mpirun ---------------------------------------------------------------------------

ROOT_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def mpirun_resume(*args: str) -> None:
    cmd = [
        "mpirun",
        "-np",
        "2",
        *ROOT_FLAGS,
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        str(SCRIPTS / "hvd_resume.py"),
        *args,
    ]
    proc = run_command(cmd, 90)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


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
    mpirun_resume("--max-steps", "8", "--out", str(a))
    # first half: ModelCheckpoint at step 4 (inside fit) and trainer.save_checkpoint after fit
    mpirun_resume(
        "--max-steps", "4", "--save-every", "4", "--save", str(tmp_path / "post.ckpt"), "--out", str(b1)
    )
    ckpt = b1 / "epoch=0-step=4.ckpt"
    mpirun_resume("--max-steps", "8", "--resume", str(ckpt), "--out", str(b2))

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

    # an old checkpoint (no per-rank states): warns, every rank resumes from rank 0's state, and ends
    # elsewhere (what every resume did before the per-rank states were kept: 9.3e-3 here)
    del saved[CHECKPOINT_KEY]
    torch.save(saved, tmp_path / "old.ckpt")
    mpirun_resume("--max-steps", "8", "--resume", str(tmp_path / "old.ckpt"), "--out", str(old))
    for r in (0, 1):
        wa, _ = load_rank(a, r)
        wo, info_o = load_rank(old, r)
        # the same on every rank, so shown once, by rank 0 (lightning_dist.warn.warn_once)
        assert len(info_o["warnings"]) == (1 if r == 0 else 0), info_o["warnings"]
        assert r != 0 or "rank 0's optimizer state" in info_o["warnings"][0]
        assert max_abs_diff(wa, wo) > 1e-4
