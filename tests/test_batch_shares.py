"""Per-rank batch shares and the balancer (lightning_dist.algorithms.batch_shares, the strategies'
part): the plan maths against float formulas, every sample once across share changes, refusals;
and at 2 CPU processes, hand shares [3, 1] under DDP, Compressed("none") and Sharded end with the
uniform DDP() run's weights, and a resume after a balancer's share change equals the uninterrupted run."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, load_rank, run_in_sequence

import lightning_dist
from lightning_dist.algorithms.batch_shares import (
    Balance,
    ShareSchedule,
    balanced_shares,
    hand_shares,
    loss_scale,
    micro_sizes,
    parse_shares,
    rank_positions,
    round_shares,
)
from lightning_dist.strategies.batch_shares import BatchShares
from lightning_dist.strategies.batch_shares_data import SharesSampler
from lightning_dist.strategies.compose import compose
from lightning_dist.strategies.sharded import Sharded
from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo
from lightning_dist.workload import TinyCausalLM, WorkloadConfig

SCRIPT = str(SCRIPTS / "shares_run.py")
BUDGET = 240
"""Seconds for the one 2-process launch of nine short fits (about 30 s on 2 shared cores)."""
DILOCO_RUNS = [
    {"name": "shares", "options": {"inner_steps": 4, "shares": [3, 1]}, "steps": 4, "record_batches": True},
]
"""DiLoCo with shares [3, 1] (tests/scripts/diloco_run.py): one sync after 4 inner AdamW steps."""
TOLERANCE = 1e-5
"""fp32: the weighted mean over ranks sums the same B per-sample gradients in another order."""


# -- the plan maths ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("weights", "total", "expected"),
    [
        ((3, 1), 8, [6, 2]),
        ((1, 1), 8, [4, 4]),
        ((1, 1, 1), 8, [3, 3, 2]),
        ((2, 1, 1, 0.5), 90, [40, 20, 20, 10]),
    ],
)
def test_hand_shares_are_proportional_and_sum_to_the_global_batch(
    weights: tuple[float, ...], total: int, expected: list[int]
) -> None:
    assert hand_shares(weights, total, 1) == expected


def test_round_shares_keep_bounds_and_sum() -> None:
    for weights in itertools.product((0.1, 1.0, 2.5, 9.0), repeat=3):
        out = round_shares(weights, 30, [3] * 3, [15] * 3)
        assert sum(out) == 30 and all(3 <= s <= 15 for s in out)
        exact = [30 * w / sum(weights) for w in weights]
        if all(3 <= e <= 15 for e in exact):  # unclipped: within one sample of the exact share
            assert all(abs(s - e) < 1 for s, e in zip(out, exact))


def test_balanced_shares_follow_speed_within_bounds() -> None:
    # rank 1 half as fast: 2/3 and 1/3 of the batch
    assert balanced_shares([1.0, 2.0], [32, 32], Balance(min_change=0)) == [43, 21]
    # bounds: no rank below low * B/W
    assert balanced_shares([1.0, 100.0], [32, 32], Balance(low=0.5, min_change=0)) == [48, 16]
    # a small move (one sample of 64, under min_change=2%) keeps the shares
    assert balanced_shares([1.0, 1.03], [32, 32], Balance(min_change=0.02)) == [32, 32]
    assert balanced_shares([1.0, 1.0], [40, 24], Balance(min_change=0.02)) == [32, 32]
    # at least one sample per micro-batch
    assert min(balanced_shares([1.0, 1e6], [4, 4], Balance(low=0, min_change=0), accumulate=2)) == 2


def test_loss_weights_make_the_uniform_mean() -> None:
    """float64: mean over ranks of (weight x rank's mean) is the mean over the B samples."""
    g = torch.Generator().manual_seed(0)
    per_sample = torch.randn(12, dtype=torch.float64, generator=g)
    for shares, accumulate in (([9, 3], 1), ([7, 5], 1), ([8, 4], 2), ([5, 4, 3], 1)):
        world, total = len(shares), sum(shares)
        ranks = []
        for r, share in enumerate(shares):
            start, stop = rank_positions(shares, r)
            samples, pos, acc = per_sample[start:stop], 0, torch.zeros((), dtype=torch.float64)
            for m in micro_sizes(share, accumulate):  # Lightning divides each by accumulate
                acc += loss_scale(world, accumulate, m, total) * samples[pos : pos + m].mean() / accumulate
                pos += m
            ranks.append(acc)
        torch.testing.assert_close(torch.stack(ranks).mean(), per_sample.mean(), rtol=1e-12, atol=1e-12)
    assert loss_scale(2, 1, 4, 8) == 1.0  # uniform shares: no weight


def test_schedule_keeps_what_later_steps_use() -> None:
    s = ShareSchedule([(0, [4, 4])])
    s.add(3, [6, 2])
    s.add(5, [5, 3])
    assert [s.at(t) for t in range(7)] == [[4, 4]] * 3 + [[6, 2]] * 2 + [[5, 3]] * 2
    s.prune(4)
    assert s.changes == [(3, [6, 2]), (5, [5, 3])]
    assert ShareSchedule.from_state(s.state_dict()) == s


def test_every_sample_once_across_share_changes() -> None:
    """Two ranks' samplers over one epoch whose shares change twice: each step's samples are the
    uniform run's step (a block of B positions), and every sample of the epoch is read once."""
    n, total = 48, 8
    samplers = []
    for rank in (0, 1):
        part = BatchShares(None, Balance())
        part.plan(2, rank, total, 2, 0)
        part.schedule = ShareSchedule([(0, [4, 4]), (2, [6, 2]), (4, [3, 5])])
        samplers.append(SharesSampler(part, n, 0, None))
    batches = [list(s) for s in samplers]
    steps = n // total
    assert [len(b) for b in batches] == [2 * steps] * 2
    seen: list[int] = []
    for step in range(steps):
        both = [i for b in batches for i in itertools.chain(*b[2 * step : 2 * step + 2])]
        assert sorted(both) == list(range(step * total, (step + 1) * total))
        seen += both
    assert sorted(seen) == list(range(n))
    assert [len(b) for b in batches[1][8:12]] == [3, 2, 3, 2]  # step 4: 5 samples as 3 + 2


@pytest.mark.parametrize("bad", ["fast", [], [3, 0], [1, float("nan")], [True, 1], 3, {"a": 1}])
def test_bad_shares_are_refused_at_construction(bad: Any) -> None:
    with pytest.raises(ValueError, match="shares="):
        lightning_dist.DDP(shares=bad)
    with pytest.raises(ValueError, match="shares="):
        parse_shares(bad)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: lightning_dist.Elastic(shares=[3, 1]), "ElasticSampler"),
        (lambda: lightning_dist.ElasticDiLoCo(shares=[3, 1]), "ElasticSampler"),
        (lambda: lightning_dist.FaultTolerant(shares="balanced"), "slots"),
        (lambda: ShardedDiLoCo(shares=[1, 1]), "pseudo-gradients"),
        (lambda: compose(layout="hybrid", sync="diloco", shares=[3, 1]), "pseudo-gradients"),
    ],
)
def test_modes_without_shares_refuse_them_naming_why(make: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        make()


def test_shares_register_one_replicated_piece_and_default_has_none() -> None:
    assert lightning_dist.DDP().batch_shares is None
    assert "batch_shares" not in lightning_dist.Compressed("none").training_state.names()
    strategy = lightning_dist.Compressed("none", shares=[3, 1])
    assert strategy.training_state.names(per_rank=False) == ["batch_shares"]
    for made in (
        Sharded(shares="balanced"),
        compose(layout="sharded", shares=[3, 1]),
        compose(shares=[3, 1]),
    ):
        assert made.batch_shares is not None
    with pytest.raises(ValueError, match="window"):
        Balance(window=0)


# -- 2 processes ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shares")
    balanced = ["--balance", "2", "--cost", "1,3"]
    run_in_sequence(
        [
            [SCRIPT, "--out", str(root / "uniform")],
            [SCRIPT, "--out", str(root / "ddp"), "--shares", "3,1"],
            [SCRIPT, "--out", str(root / "compressed"), "--strategy", "compressed", "--shares", "3,1"],
            [SCRIPT, "--out", str(root / "sharded"), "--strategy", "sharded", "--shares", "3,1"],
            [SCRIPT, "--out", str(root / "uniform_acc2"), "--accumulate", "2", "--steps", "4"],
            [SCRIPT, "--out", str(root / "ddp_acc2"), "--shares", "5,3", "--accumulate", "2", "--steps", "4"],
            [SCRIPT, "--out", str(root / "workers"), *balanced, "--workers", "1"],
            [SCRIPT, "--out", str(root / "balanced"), *balanced, "--ckpt-at", "3"],
            [SCRIPT, "--out", str(root / "resumed"), *balanced, "--resume", str(root / "balanced" / "at-step=3.ckpt")],
            # last: its script ends its fits with the process group down
            [str(SCRIPTS / "diloco_run.py"), "--out", str(root / "diloco"), "--runs", json.dumps(DILOCO_RUNS)],
        ],
        timeout=BUDGET,
    )  # fmt: skip
    return root


def _steps(info: dict[str, Any]) -> dict[int, list[int]]:
    """The indices each step trained on this rank (its micro-batches' together)."""
    out: dict[int, list[int]] = {}
    for row in info["seen"]:
        out.setdefault(row[0], []).extend(row[1:])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "compressed", "sharded", "balanced"])
def test_shares_end_with_the_uniform_runs_weights(runs: Path, name: str) -> None:
    uniform, _ = load_rank(runs / "uniform", 0)
    uniform_steps = [_steps(load_rank(runs / "uniform", r)[1]) for r in (0, 1)]
    for rank in (0, 1):
        weights, info = load_rank(runs / name, rank)
        assert_same_weights(weights, uniform, atol=TOLERANCE)
    infos = [load_rank(runs / name, r)[1] for r in (0, 1)]
    steps = [_steps(i) for i in infos]
    for step in range(8):  # the same B samples at every step, split by the shares
        assert sorted(steps[0][step] + steps[1][step]) == sorted(
            uniform_steps[0][step] + uniform_steps[1][step]
        )
    if name != "balanced":
        assert [len(steps[r][0]) for r in (0, 1)] == [6, 2]


@pytest.mark.slow
def test_shares_with_accumulation_end_with_the_uniform_runs_weights(runs: Path) -> None:
    """B = 16 over 2 ranks x 2 micro-batches; shares [5, 3] give rank 1 micro-batches of 3 and 3,
    rank 0 of 5 and 5: the per-micro-batch weights make the uniform update."""
    uniform, _ = load_rank(runs / "uniform_acc2", 0)
    for rank in (0, 1):
        weights, info = load_rank(runs / "ddp_acc2", rank)
        assert_same_weights(weights, uniform, atol=TOLERANCE)
        assert [len(row) - 1 for row in info["seen"]] == ([5, 5] if rank == 0 else [3, 3]) * 4
    assert info["global_step"] == 4


@pytest.mark.slow
def test_balancer_moves_shares_to_speed_and_every_sample_once(runs: Path) -> None:
    infos = [load_rank(runs / "balanced", r)[1] for r in (0, 1)]
    assert infos[0]["changes"] == [[2, [6, 2]]]  # rank 1 three times slower per sample
    assert infos[0]["schedule"] == infos[1]["schedule"]
    steps = [_steps(i) for i in infos]
    assert [len(steps[1][s]) for s in range(8)] == [4, 4] + [2] * 6
    seen = [i for s in range(8) for r in (0, 1) for i in steps[r][s]]
    assert sorted(seen) == list(range(64))  # the epoch: every sample once


@pytest.mark.slow
def test_with_loader_workers_a_new_plan_waits_for_what_they_read_ahead(runs: Path) -> None:
    """One worker reads num_workers * prefetch_factor = 2 batches ahead: the plan agreed after step 2
    starts at step 4, and the run still ends with the uniform run's weights."""
    uniform, _ = load_rank(runs / "uniform", 0)
    for rank in (0, 1):
        weights, info = load_rank(runs / "workers", rank)
        assert info["changes"] == [[4, [6, 2]]]
        assert_same_weights(weights, uniform, atol=TOLERANCE)


@pytest.mark.slow
def test_diloco_weighs_pseudo_gradients_by_samples_trained(runs: Path) -> None:
    """Each rank's inner AdamW steps on its own share, unweighted; at the sync the pseudo-gradients
    are weighed by samples trained (3/4 and 1/4 of B: 1.5 and 0.5 times, then averaged), as
    tests/references.py's DiLoCo writes out with those weights."""
    import references

    out = runs / "diloco"
    batches = [torch.load(out / f"shares.rank{r}.batches.pt") for r in (0, 1)]
    assert [len(b[0][0]) for b in batches] == [12, 4]  # the workload's batch_size 8: B = 16
    start = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    expected = references.diloco(start, batches, 4, 0.7, 0.9, 3e-3, 0.01, weights=[1.5, 0.5])
    unweighted = references.diloco(start, batches, 4, 0.7, 0.9, 3e-3, 0.01)
    got = torch.load(out / "shares.rank0.pt")
    assert_same_weights(got, expected[0], atol=1e-6)
    assert max(float((got[k] - unweighted[0][k]).abs().max()) for k in got) > 1e-5  # the weights matter
    assert_same_weights(torch.load(out / "shares.rank1.pt"), got, atol=0)


@pytest.mark.slow
def test_resume_after_a_share_change_equals_the_uninterrupted_run(runs: Path) -> None:
    checkpoint = torch.load(runs / "balanced" / "at-step=3.ckpt", weights_only=False)
    state = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert state["step"] == 3 and state["batch_shares"]["schedule"] == [[0, [4, 4]], [2, [6, 2]]]
    for rank in (0, 1):
        whole, whole_info = load_rank(runs / "balanced", rank)
        resumed, info = load_rank(runs / "resumed", rank)
        assert_same_weights(resumed, whole, atol=0)
        assert _steps(info) == {s: v for s, v in _steps(whole_info).items() if s >= 3}
    assert json.loads((runs / "resumed" / "rank0.json").read_text())["global_step"] == 8
