"""DDP(reduce_op="adasum") over Gloo: one SGD step against an independent Adasum reference, then
training at 2 and 3 ranks (Horovod's Adasum can do neither Gloo nor 3 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, load_rank, max_abs_diff, run_in_sequence, run_script
from references import adasum_pair, local_gradients

from lightning_dist.workload import TinyCausalLM, WorkloadConfig

pytestmark = pytest.mark.slow
LR = 0.5
ATOL = 1e-6


TRAIN = ["--strategy", "ld_ddp_adasum", "--max-steps", "12"]
"""ddp_run.py's flags for the training runs."""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-step run ("step") and the 2-rank training ("adasum2"), one after another in one
    2-process launch (budget: at most half the 300 s test timeout)."""
    root = tmp_path_factory.mktemp("two_ranks")
    run_in_sequence(
        [["one_step.py", "--strategy", "ld_ddp_adasum", "--optimizer", "sgd", "--lr", str(LR),
          "--out", str(root / "step")],
         ["ddp_run.py", *TRAIN, "--devices", "2", "--out", str(root / "adasum2")]],
        timeout=150,
    )  # fmt: skip
    return root


def test_one_sgd_step_is_p0_minus_lr_adasum_of_the_gradients(two_ranks: Path) -> None:
    out = two_ranks / "step"
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    start = ranks[0]["start"]
    g0, g1 = (local_gradients(start, r["batch"]) for r in ranks)
    assert max_abs_diff(g0, g1) > 1e-3, "the ranks must see different batches"
    adasum = {n: start[n] - LR * adasum_pair(g0[n], g1[n]).float() for n in g0}
    average = {n: start[n] - LR * (g0[n] + g1[n]) / 2 for n in g0}
    for r in ranks:
        final = {n: r["final"][n] for n in g0}
        assert max_abs_diff(final, adasum) < ATOL, (
            f"off the Adasum reference by {max_abs_diff(final, adasum)}"
        )
        assert max_abs_diff(final, average) > 100 * ATOL, "a plain average would pass too: the test is blind"


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_adasum_trains_and_ranks_stay_identical(
    request: pytest.FixtureRequest, tmp_path: Path, world_size: int
) -> None:
    if world_size == 2:
        out = request.getfixturevalue("two_ranks") / "adasum2"
    else:
        out = tmp_path / "adasum"
        run_script([str(SCRIPTS / "ddp_run.py"), *TRAIN, "--devices", str(world_size), "--out", str(out)],
                   timeout=150)  # fmt: skip
    w0, info0 = load_rank(out, 0)
    assert info0["world_size"] == world_size
    assert info0["hook_calls"] > 0
    for rank in range(1, world_size):
        assert_same_weights(load_rank(out, rank)[0], w0, atol=0)
    initial = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    assert any(not torch.equal(initial[k], w0[k]) for k in w0)
    per_step = [
        sum(load_rank(out, r)[1]["losses"][i] for r in range(world_size)) / world_size for i in range(12)
    ]
    assert sum(per_step[-3:]) / 3 < sum(per_step[:3]) / 3 - 0.2, per_step
