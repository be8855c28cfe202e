"""skip_nonfinite=True on DDP, Compressed and Elastic (its default): a NaN gradient on one rank skips that step on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import SCRIPTS, assert_same_weights, load_rank, run_script

pytestmark = pytest.mark.slow
NAN_STEP = 3


@pytest.mark.parametrize("strategy", ["ddp", "powersgd", "elastic"])
def test_nan_on_one_rank_skips_the_same_step_everywhere(tmp_path: Path, strategy: str) -> None:
    out = tmp_path / strategy
    run_script(
        [str(SCRIPTS / "nonfinite_run.py"), "--strategy", strategy, "--nan-rank", "1",
         "--nan-step", str(NAN_STEP), "--max-steps", "6", "--out", str(out)],
        timeout=120,
    )  # fmt: skip
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
