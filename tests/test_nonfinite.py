"""skip_nonfinite=True on DDP, Compressed and Elastic (its default): a NaN gradient on one rank skips that step on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import assert_same_weights, load_rank, run_in_sequence

pytestmark = pytest.mark.slow
NAN_STEP = 3
STRATEGIES = ("ddp", "powersgd", "elastic")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-process fit with each strategy, one after another in one launch (budget: at most half the
    300 s test timeout)."""
    root = tmp_path_factory.mktemp("nonfinite")
    run_in_sequence(
        [["nonfinite_run.py", "--strategy", strategy, "--nan-rank", "1", "--nan-step", str(NAN_STEP),
          "--max-steps", "6", "--out", str(root / strategy)] for strategy in STRATEGIES],
        timeout=120,
    )  # fmt: skip
    return root


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_on_one_rank_skips_the_same_step_everywhere(runs: Path, strategy: str) -> None:
    out = runs / strategy
    (w0, info0), (w1, info1) = load_rank(out, 0), load_rank(out, 1)
    assert info0["global_step"] == info1["global_step"] == 6, "no rank hung or stopped early"
    assert info0["skipped"] == info1["skipped"] == 1 and info0["logged"] == 1.0
    assert_same_weights(w0, w1, atol=0)
    sums = info0["param_sums"]
    assert sums == info1["param_sums"], "the ranks took different steps"
    for step in range(1, len(sums)):
        if step == NAN_STEP:
            assert sums[step] == sums[step - 1], "the poisoned step must leave the weights as they were"
        else:
            assert sums[step] != sums[step - 1], f"step {step} must update the weights"
