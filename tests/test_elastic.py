"""Elastic under torchrun (2 CPU workers, Gloo): a killed worker costs at most ``commit_every`` steps,
every sample is used once, and the final weights equal a fault-free run's."""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, run_command

pytestmark = pytest.mark.slow
COMMIT_EVERY, STEPS, GLOBAL_BATCH = 3, 12, 8  # tiny workload: batch 4 per rank, 2 ranks


def torchrun(out: Path, *args: str, max_restarts: int = 1, timeout: float = 120, **env: str) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={max_restarts}", str(SCRIPTS / "elastic_run.py"), "--out", str(out),
           "--commit-every", str(COMMIT_EVERY), "--max-steps", str(STEPS), *args]  # fmt: skip
    proc = run_command(cmd, timeout, PYTHONPATH=str(SCRIPTS), **env)
    if proc.returncode != 0 and not env:
        print(proc.stdout[-3000:], proc.stderr[-6000:])
    return proc.returncode


def final_trajectory(out: Path) -> dict[int, list[int]]:
    """Samples of every optimizer step as its last execution read them (all ranks, sorted)."""
    runs: dict[tuple[int, int], dict[int, list[int]]] = {}
    for path in out.glob("samples.rank*.attempt*.jsonl"):
        match = re.fullmatch(r"samples\.rank(\d+)\.attempt(\d+)\.jsonl", path.name)
        assert match is not None, path.name
        rank, attempt = int(match.group(1)), int(match.group(2))
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            runs.setdefault((entry["step"], rank), {}).setdefault(attempt, []).extend(entry["samples"])
    steps: dict[int, list[int]] = collections.defaultdict(list)
    for (step, _), attempts in runs.items():
        steps[step].extend(attempts[max(attempts)])
    return {step: sorted(samples) for step, samples in steps.items()}


REDUCTIONS = {
    "average": [],
    "powersgd": ["--compression", "powersgd"],  # per-rank residuals and Q come back from the commit
    "adasum": ["--reduce-op", "adasum"],
}


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_sigkill_mid_epoch_resumes_from_the_last_commit(tmp_path: Path, reduction: str) -> None:
    fault_free, out = tmp_path / "fault_free", tmp_path / "killed"
    assert torchrun(fault_free, *REDUCTIONS[reduction]) == 0
    assert torchrun(out, *REDUCTIONS[reduction], "--kill-rank", "1", "--kill-step", "7") == 0
    facts = json.loads((out / "rank0.json").read_text())
    assert facts["attempt"] == 1 and facts["global_step"] == STEPS
    assert facts["resumed_from"] == 6, "the newest commit before the kill at step 7"
    assert 7 - facts["resumed_from"] <= COMMIT_EVERY
    killed = final_trajectory(out)
    assert sorted(killed) == list(range(STEPS))
    used = [s for step in killed.values() for s in step]
    assert len(used) == STEPS * GLOBAL_BATCH and len(set(used)) == len(used), "a sample used twice"
    assert killed == final_trajectory(fault_free), "the same samples at every step as the fault-free run"
    assert any(p.name.startswith("samples.rank1.attempt0") for p in out.iterdir())
    assert_same_weights(torch.load(out / "rank0.pt"), torch.load(fault_free / "rank0.pt"), atol=1e-6)


def test_restarts_exhausted_exit_non_zero_in_bounded_time(tmp_path: Path) -> None:
    start = time.monotonic()
    code = torchrun(
        tmp_path / "doomed", "--kill-rank", "1", "--kill-step", "2", max_restarts=1,
        ELASTIC_RUN_KILL_EVERY_ATTEMPT="1",
    )  # fmt: skip
    assert code != 0
    assert time.monotonic() - start < 100


def test_run_elastic_restarts_workers_without_torchrun(tmp_path: Path) -> None:
    results = {}
    for name, kill in (("fault_free", "-1"), ("killed", "5")):
        out = tmp_path / name
        out.mkdir()
        proc = run_command([sys.executable, str(SCRIPTS / "elastic_inline.py"), "--out", str(out),
                            "--kill-step", kill], 120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-6000:]
        results[name] = json.loads((out / "results.json").read_text())
    killed, clean = results["killed"], results["fault_free"]
    for rank in ("0", "1"):
        assert clean[rank]["attempt"] == 0 and clean[rank]["resumed_from"] is None
        assert (
            killed[rank]["attempt"] == 1 and killed[rank]["resumed_from"] == 3 and killed[rank]["step"] == 9
        )
        assert killed[rank]["weights"] == clean[rank]["weights"]
