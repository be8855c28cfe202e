"""DDP(reduce_op="adasum") over Gloo at 2 and 3 ranks (Horovod's Adasum cannot do either Gloo or 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, load_rank, run_script

from lightning_dist.workload import TinyCausalLM, WorkloadConfig

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_adasum_trains_and_ranks_stay_identical(tmp_path: Path, world_size: int) -> None:
    out = tmp_path / "adasum"
    run_script(
        [
            str(SCRIPTS / "ddp_run.py"),
            "--strategy",
            "ld_ddp_adasum",
            "--devices",
            str(world_size),
            "--max-steps",
            "12",
            "--out",
            str(out),
        ]
    )
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
