"""benchmarks/failure_figures.py: the failure-rate benchmark's kill schedule (reproducible from its
seed, bounded) and its figures from hand-written rows (no processes)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "failure_figures.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("failure_figures", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("failure_figures", module)
    spec.loader.exec_module(module)
    return module


ff = load()


def test_schedule_is_reproducible_and_bounded() -> None:
    a = ff.kill_schedule(300, 10, 3, seed=7)
    assert a == ff.kill_schedule(300, 10, 3, seed=7)
    assert a != ff.kill_schedule(300, 10, 3, seed=8)
    assert [t for t, _ in a] == [10.0 * k for k in range(1, 30)]  # 29 kills, none at the window's end
    assert {g for _, g in a} == {0, 1, 2}
    assert len(ff.kill_schedule(300, 30, 3, seed=0)) == 9
    assert len(ff.kill_schedule(60, 20, 3, seed=0)) == 2
    assert len(ff.kill_schedule(65, 20, 3, seed=0)) == 3


@pytest.mark.parametrize("bad", [dict(duration_s=0, every_s=1, groups=3), dict(duration_s=10, every_s=-1, groups=3),
                                 dict(duration_s=10, every_s=1, groups=1)])  # fmt: skip
def test_schedule_rejects_bad_input(bad: dict) -> None:
    with pytest.raises(ValueError):
        ff.kill_schedule(seed=0, **bad)


def row(step: int, t: float, group: int, indices: list[int], participants: int = 2, attempt: int = 0) -> dict:
    return {"step": step, "t": t, "group": group, "indices": indices, "participants": participants,
            "attempt": attempt}  # fmt: skip


REFERENCE = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9, 10, 11], 3: [12, 13, 14, 15]}


def test_statuses_and_samples_trained_once() -> None:
    rows = [
        row(0, 1.0, 0, [0, 1]), row(0, 1.0, 1, [2, 3]),      # ok
        row(1, 2.0, 0, [4, 5]),                              # group 1 killed after the commit: unrecorded
        row(2, 3.0, 0, [8, 9, 10, 11], participants=1),      # alone: ok
        row(3, 4.0, 0, [12, 13], participants=1),            # lost
    ]  # fmt: skip
    statuses = ff.step_statuses(rows, range(5), REFERENCE)
    assert statuses == {"ok": 2, "unrecorded": 1, "lost": 1, "missing": 1}
    assert ff.trained_once(statuses, 4) == 12
    assert ff.step_status([row(0, 1, 0, [0, 1]), row(0, 1, 1, [1, 2])], 0, REFERENCE[0]) == "repeated"
    assert ff.step_status([row(0, 1, 0, [0, 99], participants=1)], 0, REFERENCE[0]) == "other"


def test_window_redone_and_failure_figures() -> None:
    # group 0 steps every second; group 1 is killed at t=3.5 and back (attempt 1) at t=6
    rows = [row(s, float(s), 0, [s]) for s in range(10)]
    rows[4]["t"] = 5.0  # the survivor's step during the failure takes 2 s (its median: 1 s)
    rows += [row(s, float(s), 1, [100 + s]) for s in range(4)]
    rows += [row(s, float(s), 1, [100 + s], attempt=1) for s in range(6, 10)]
    assert ff.steps_in_window(rows, 2.0, 8.0) == [2, 3, 4, 5, 6, 7]
    assert ff.redone_steps(rows) == 0
    assert ff.redone_steps(rows + [row(7, 9.5, 1, [1], attempt=1)]) == 1
    kills = [{"t": 3.5, "group": 1, "hit": True}, {"t": 8.0, "group": 0, "hit": False}]
    figures = ff.failure_figures(rows, kills, 2, 0.0, 10.0)
    assert figures["recovery_s"] == [pytest.approx(2.5)]
    assert figures["slowest_over_median"] == [pytest.approx(2.0)]
    never = ff.failure_figures(rows[:10], [{"t": 3.5, "group": 1, "hit": True}], 2, 0.0, 10.0)
    assert never["recovery_s"] == [math.inf]
    # failing from 3.5 to 6 (group 1 back): outside it, 8 steps first committed in 7.5 s of the window
    assert ff.healthy_expected_steps(rows, kills, 0.0, 10.0) == pytest.approx(8 / 7.5 * 10)
    assert ff.distribution([3.0, 1.0, 2.0]) == "2.00 (1.00-3.00), n=3"
