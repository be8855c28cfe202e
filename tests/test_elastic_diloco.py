"""ElasticDiLoCo: DiLoCo with Elastic's commits. Fast: options, registry, the class layout. Slow, under
torchrun (2 CPU workers, Gloo): a worker SIGKILLed mid-period resumes from the last commit (which holds
DiLoCo's entry) and ends bitwise on the fault-free weights; a resume at another world size takes
DiLoCo's fallback (the last-sync parameters, with a warning); a fit of 7 steps (inside the second
period) ends both workers on the same weights."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import shared_runs
import torch
from helpers import assert_same_weights, max_abs_diff, runs_test
from lightning.pytorch.strategies import StrategyRegistry
from test_elastic import (
    GLOBAL_BATCH,
    STEPS,
    Launch,
    Ran,
    final_trajectory,
    launch_all,
    launched,
    sample_log,
    torchrun_case,
    torchrun_proc,
)

import lightning_dist
from lightning_dist import DiLoCo, Elastic, ElasticDiLoCo
from lightning_dist.elastic import commits
from lightning_dist.launch.slurm import resolve_strategy
from lightning_dist.strategies import Compressed, ElasticMixin
from lightning_dist.strategies.diloco import CHECKPOINT_KEY
from lightning_dist.strategies.elastic_commits import ELASTIC_KEY

H = 4  # inner steps; test_elastic's commit_every=3 puts the commits at steps 3 and 6 mid-period
DILOCO = ["--diloco", str(H)]


# -- fast: options, registry ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"commit_every": 0}, r"commit_every=0 must be an integer >= 1"),
        ({"keep": 0}, r"keep=0 must be an integer >= 1"),
        ({"dirpath": 3}, r"dirpath=3 is not supported; accepted: None, a str or a path"),
        ({"on_indivisible": "guess"}, r"on_indivisible='guess' is not supported"),
        ({"background_commits": 1}, r"background_commits=1 must be True or False"),
        ({"inner_steps": 0}, r"inner_steps=0 must be an integer >= 1"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0 must be in \[0, 1\)"),
        ({"compression": "powersgd"}, r"compression='powersgd' is not supported by DiLoCo"),
        (
            {"skip_nonfinite": True},
            r"ElasticDiLoCo: skip_nonfinite=True is not supported \(DiLoCo has no gradient all-reduce\); "
            r"accepted options: commit_every, keep, dirpath, .*inner_steps",
        ),
        ({"reduce_op": "adasum"}, r"ElasticDiLoCo: reduce_op='adasum' is not supported"),
        (
            {"commit_evry": 5},
            r"ElasticDiLoCo got unknown option\(s\) commit_evry; accepted: commit_every, .*, inner_steps",
        ),
    ],
)
def test_bad_arguments_fail_early_naming_them(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ElasticDiLoCo(**kwargs)


def test_defaults_layout_and_registered_name() -> None:
    s = ElasticDiLoCo(inner_steps=4, commit_every=3, keep=2, compression="int8", scale_lr=False)
    assert (s.inner_steps, s.commit_every, s.keep, s.scale_lr) == (4, 3, 2, False)
    assert s.compressor.name == "int8" and s.nonfinite is None, "no skip_nonfinite guard under DiLoCo"
    assert s.background_commits and s.resumed_from is None and s.lr_factor == 1.0
    assert isinstance(s, ElasticMixin) and isinstance(s, DiLoCo) and not isinstance(s, Compressed)
    assert isinstance(Elastic(), ElasticMixin) and isinstance(Elastic(), Compressed)
    assert lightning_dist.ElasticDiLoCo is ElasticDiLoCo
    assert StrategyRegistry["ld_elastic_diloco"]["strategy"] is ElasticDiLoCo
    assert StrategyRegistry["ld_elastic"]["strategy"] is Elastic
    assert StrategyRegistry["ld_diloco"]["strategy"] is DiLoCo, "ElasticDiLoCo does not take DiLoCo's names"
    assert resolve_strategy("elastic_diloco").family == "elastic", "one torchrun per node under SLURM"
    assert resolve_strategy("ElasticDiLoCo").family == "elastic"
    assert ElasticDiLoCo._accepted_options()[:7] == [
        "commit_every", "keep", "dirpath", "seed", "on_indivisible", "scale_lr", "background_commits",
    ]  # fmt: skip


# -- slow: torchrun ------------------------------------------------------------------------------
def resized_run(shared_torchrun: dict[str, Path], out: Path) -> subprocess.CompletedProcess[str]:
    """A copy at ``out`` of the 2-worker run that stopped after step 7, resumed by 1 worker."""
    shutil.copytree(shared_torchrun["diloco_stopped_after_7"], out)
    return torchrun_proc(out, *DILOCO, nproc=1, max_restarts=0, timeout=80)


@pytest.fixture(scope="module")
def diloco_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """``launch_all`` of this file's launches this session runs, at once: rank 1 killed after step 7
    ("killed"), and a resume on 1 worker ("resized", ``resized_run``)."""
    cases: dict[str, Launch] = {}
    if runs_test(request, test_sigkill_mid_period_resumes_bitwise):
        cases["killed"] = torchrun_case(*DILOCO, "--kill-rank", "1", "--kill-step", "7", timeout=100)
    if runs_test(request, test_resume_at_another_world_size_starts_from_the_last_sync):
        cases["resized"] = functools.partial(resized_run, request.getfixturevalue("shared_torchrun"))
    return launch_all(tmp_path_factory.mktemp("diloco"), cases)


@pytest.mark.slow
@pytest.mark.timeout(2 * shared_runs.BUDGET)  # the shared fault-free runs may start here
def test_sigkill_mid_period_resumes_bitwise(
    diloco_runs: dict[str, Ran], shared_torchrun: dict[str, Path]
) -> None:
    """Rank 1 is killed after step 7; the commit of step 6 (inner step 2 of the second period: the
    ranks' weights differ) is the resume point; the run ends on the fault-free run's weights, bitwise
    (the fault-free run: tests/shared_runs.py)."""
    fault_free, (out, proc) = shared_torchrun["diloco"], launched(diloco_runs, "killed")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "DiLoCo:" not in proc.stderr, "no fallback: the commit holds every rank's DiLoCo state"
    for rank in (0, 1):
        facts = json.loads((out / f"rank{rank}.json").read_text())
        assert facts["attempt"] == 1 and facts["global_step"] == STEPS and facts["resumed_from"] == 6
        assert (facts["syncs"], facts["inner_step"]) == (STEPS // H, 0)
        got, expected = torch.load(out / f"rank{rank}.pt"), torch.load(fault_free / f"rank{rank}.pt")
        print(f"rank {rank}: max abs diff to the fault-free run {max_abs_diff(got, expected):.3g}")
        assert_same_weights(got, expected, atol=0)
    killed = final_trajectory(out)
    assert sorted(killed) == list(range(STEPS))
    used = [s for step in killed.values() for s in step]
    assert len(used) == STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample used twice"
    assert killed == final_trajectory(fault_free)
    assert any(e["rank"] == 1 and e["attempt"] == 0 for e in sample_log(out)), "the killed attempt logged"
    # the fault-free run's commit of step 6 (kept: keep=3 holds 6, 9, 12) has DiLoCo's whole state
    state = commits._read_commit(commits.CommitStore(fault_free / "commits").path(6), "cpu")
    entry = state[CHECKPOINT_KEY]
    assert (entry["world_size"], entry["inner_steps"], entry["inner_step"], entry["syncs"]) == (2, H, 2, 1)
    r0, r1 = entry["ranks"]
    assert max_abs_diff(r0["state_dict"], r1["state_dict"]) > 0, "mid-period the ranks' weights differ"
    assert r0["optimizer_states"] and r1["optimizer_states"], "every rank's inner optimizer state"
    assert entry["outer"]["anchors"] and entry["outer"]["momentum"], "last-sync params, outer momentum"
    assert state[ELASTIC_KEY]["world_size"] == 2


@pytest.mark.slow
@pytest.mark.timeout(2 * shared_runs.BUDGET)  # the shared fault-free runs may start here
def test_resume_at_another_world_size_starts_from_the_last_sync(diloco_runs: dict[str, Ran]) -> None:
    """2 workers stop after step 7 (commits 3 and 6; a copy of tests/shared_runs.py's run); 1 worker
    resumes from commit 6 with DiLoCo's warning: the steps since the last sync are dropped (inner step
    0), the sync count is kept, and the global batch too (2 micro-batches per step), so it trains on
    every remaining sample once."""
    out, proc = launched(diloco_runs, "resized")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "DiLoCo: the checkpoint was saved at world size 2, this run has 1" in proc.stderr
    facts = json.loads((out / "rank0.json").read_text())
    assert facts["world_size"] == 1 and facts["global_step"] == STEPS and facts["resumed_from"] == 6
    # from step 6 at inner step 0: one sync at step 10, then 2 inner steps synced at the end (the tail)
    assert (facts["syncs"], facts["inner_step"]) == (3, 0)
    trajectory = final_trajectory(out)
    assert sorted(trajectory) == list(range(STEPS))
    used = [s for step in trajectory.values() for s in step]
    assert len(used) == STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample used twice"
    assert all(torch.isfinite(t).all() for t in torch.load(out / "rank0.pt").values())


@pytest.mark.slow
@pytest.mark.timeout(2 * shared_runs.BUDGET)  # the shared fault-free runs may start here
def test_a_fit_ending_inside_a_period_ends_both_workers_on_the_same_weights(
    shared_torchrun: dict[str, Path],
) -> None:
    """tests/shared_runs.py's ElasticDiLoCo(inner_steps=4) run of max_steps=7: the 3 steps after the
    sync at 4 are synced at the end of fit (a second sync), so both workers end bitwise on the same
    weights, which moved from the first sync's."""
    out = shared_torchrun["diloco_stopped_after_7"]
    facts = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all((f["global_step"], f["syncs"], f["inner_step"]) == (7, 2, 0) for f in facts), facts
    r0, r1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert_same_weights(r1, r0, atol=0)
    first_sync = commits._read_commit(commits.CommitStore(out / "commits").path(6), "cpu")[CHECKPOINT_KEY]
    assert max_abs_diff(first_sync["outer"]["anchors"], r0) > 1e-4, "the tail moved the weights"
