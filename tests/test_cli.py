"""The `lightning-dist` command: `env` reports, `demo` trains every strategy and prints the table."""

from __future__ import annotations

import pytest
from helpers import run_script


def test_env_lists_versions_and_launchers() -> None:
    out = run_script(["python", "-m", "lightning_dist.cli", "env"], timeout=60).stdout
    assert "torch" in out and "lightning" in out and "mpirun" in out


@pytest.mark.slow
def test_demo_prints_one_row_per_strategy() -> None:
    from lightning_dist.demo import demo_runs

    out = run_script(["python", "-m", "lightning_dist.cli", "demo", "--steps", "4"], timeout=600).stdout
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "strategy"
    rows = {line.split("|")[1].strip(): line for line in table[1:]}
    for run in demo_runs():
        assert run.label in rows, out
        assert "failed" not in rows[run.label]
    ours = rows["DDP()"].split("|")
    assert ours[2].strip().endswith("ms") and int(ours[3].strip().replace(",", "")) > 0
