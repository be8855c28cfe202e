"""A model that differs between ranks: the same clear ValueError on every rank, never a hang.

The fast tests check ``check_same_model`` on threaded Gloo ranks; the slow ones fit a model that
rank 1 builds differently (tests/scripts/mismatched_model.py) under DDP, Compressed, Elastic
(torchrun), Horovod and HorovodAdasum (mpirun), two CPU ranks each.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Union

import pytest
import torch
from helpers import MPIRUN_TWO_RANKS, SCRIPTS, concurrently, lanes_budget, run_command, selected_cases
from torch import nn

from lightning_dist.collectives import Communicator
from lightning_dist.collectives.model_check import check_same_model
from lightning_dist.testing import run_in_threads

HINT = "Build the same model on every rank: check for rank-dependent code in __init__/configure_model"


def outcomes(world_size: int, build: Callable[[int], nn.Module]) -> list[str | None]:
    """Every rank's ``check_same_model`` message (None: it passed) for the model ``build(rank)`` makes."""

    def body(comm: Communicator) -> str | None:
        try:
            check_same_model(build(comm.rank), "DDP", comm)
        except ValueError as err:
            return str(err)
        return None

    return run_in_threads(world_size, body, timeout=30)


def same_everywhere(messages: list[str | None]) -> str:
    assert messages[0] is not None, "rank 0 got no error"
    assert all(m == messages[0] for m in messages), messages
    assert messages[0].startswith("DDP: the model differs between ranks") and HINT in messages[0]
    return messages[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_model_passes(world_size: int) -> None:
    assert (
        outcomes(world_size, lambda r: nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)))
        == [None] * world_size
    )


def test_other_shape_names_the_parameter_and_both_shapes() -> None:
    msg = same_everywhere(outcomes(3, lambda r: nn.Linear(8, 5 if r == 2 else 4)))
    assert "(rank 2 differs from rank 0)" in msg
    assert "parameter 'weight' has shape (4, 8) float32 on rank 0 but shape (5, 8) float32 on rank 2" in msg


def test_extra_and_missing_layers() -> None:
    def build(extra_on: int) -> Callable[[int], nn.Module]:
        return lambda r: nn.Sequential(nn.Linear(4, 4), *([nn.Linear(4, 4)] if r == extra_on else []))

    msg = same_everywhere(outcomes(2, build(extra_on=1)))
    assert "parameter '1.weight' (shape (4, 4) float32 on rank 1) is missing on rank 0" in msg
    msg = same_everywhere(outcomes(2, build(extra_on=0)))
    assert "parameter '1.weight' (shape (4, 4) float32 on rank 0) is missing on rank 1" in msg


def test_dtype_frozen_buffer_and_order_differences() -> None:
    msg = same_everywhere(outcomes(2, lambda r: nn.Linear(2, 2).to(torch.float64 if r else torch.float32)))
    assert "shape (2, 2) float32 on rank 0 but shape (2, 2) float64 on rank 1" in msg

    def frozen(r: int) -> nn.Module:
        m = nn.Linear(2, 2)
        m.bias.requires_grad_(r == 0)
        return m

    assert (
        "parameter 'bias' has shape (2,) float32 on rank 0 but shape (2,) float32, requires_grad=False"
        in (same_everywhere(outcomes(2, frozen)))
    )
    msg = same_everywhere(outcomes(2, lambda r: nn.BatchNorm1d(3 + r)))
    assert "parameter 'weight' has shape (3,) float32 on rank 0 but shape (4,) float32 on rank 1" in msg

    def ordered(r: int) -> nn.Module:
        m = nn.Module()
        for name in ("a", "b") if r == 0 else ("b", "a"):
            m.register_parameter(name, nn.Parameter(torch.zeros(2)))
        return m

    assert "registered in a different order" in same_everywhere(outcomes(2, ordered))


def test_several_ranks_differ() -> None:
    msg = same_everywhere(outcomes(3, lambda r: nn.Linear(2, 2 + r)))
    assert "(ranks 1, 2 differ from rank 0)" in msg and "on rank 1" in msg


# -- the strategies, two ranks in child processes ----------------------------------------------------
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--max-restarts=0"]  # fmt: skip
BUDGET_S = 60.0
"""Seconds for one launch (alone: 6-15 s on 2 cores)."""
LANES = 2
"""Launches at once: alone, one keeps about one of the 2 cores busy; more would only share the cores'
import work (each rank imports torch and Lightning), each launch slower, nearer its budget (at 3 lanes
on a loaded machine, launches of the second wave ran past 60 s)."""

NO_HOROVOD = shutil.which("mpirun") is None or importlib.util.find_spec("horovod") is None
horovod = [pytest.mark.horovod, pytest.mark.skipif(NO_HOROVOD, reason="needs horovod and mpirun")]

CASES = [
    pytest.param("ddp", "shape", [sys.executable], id="ddp"),
    pytest.param("compressed", "shape", [sys.executable], id="compressed"),
    pytest.param("elastic", "shape", TORCHRUN, id="elastic"),
    pytest.param("horovod", "shape", [*MPIRUN_TWO_RANKS, sys.executable], id="horovod", marks=horovod),
    pytest.param("ddp", "extra", [sys.executable], id="ddp-extra-layer"),
    pytest.param(
        "horovod_adasum",
        "extra",
        [*MPIRUN_TWO_RANKS, sys.executable],
        id="horovod_adasum-extra-layer",
        marks=horovod,
    ),
]
EXPECTED = {
    "shape": "parameter 'net.0.weight' has shape (4, 8) float32 on rank 0 but shape (5, 8) float32 on rank 1",
    "extra": "parameter 'net.3.weight' (shape (1, 1) float32 on rank 1) is missing on rank 0",
}
Launched = tuple[Path, Union[subprocess.CompletedProcess[str], AssertionError]]
"""A case's out folder and its finished launch, or the budget's error with the ranks' output."""
OWNER = {"ddp": "DDP", "compressed": "Compressed", "elastic": "Elastic", "horovod": "Horovod"}


@pytest.fixture(scope="module")
def mismatched_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Launched]:
    """The launch of every case this session runs, ``LANES`` at a time (``concurrently``; alone, a
    launch leaves a core idle: its ranks wait on each other's start and outcome), each in its own out
    folder within ``BUDGET_S``. (strategy, mismatch) -> ``Launched`` (a budget's error is raised by
    that case's test)."""
    root = tmp_path_factory.mktemp("mismatched")

    def launch(strategy: str, mismatch: str, launcher: list[str]) -> Launched:
        out = root / f"{strategy}-{mismatch}" / strategy
        cmd = [*launcher, str(SCRIPTS / "mismatched_model.py"), "--strategy", strategy,
               "--mismatch", mismatch, "--out", str(out)]  # fmt: skip
        try:
            return out, run_command(cmd, BUDGET_S)
        except AssertionError as exc:  # a hang, killed with its output
            return out, exc

    test = test_every_rank_gets_the_error
    cases = [
        case
        for case in selected_cases(request, test, "strategy", "mismatch", "launcher")
        if not (NO_HOROVOD and case[0].startswith("horovod"))  # those tests are skipped
    ]

    calls = {(strategy, mismatch): partial(launch, strategy, mismatch, launcher)
             for strategy, mismatch, launcher in cases}  # fmt: skip
    return concurrently(calls, at_once=LANES)


@pytest.mark.slow
@pytest.mark.timeout(2 * lanes_budget(len(CASES), BUDGET_S, LANES))  # twice the fixture's budget
@pytest.mark.parametrize(("strategy", "mismatch", "launcher"), CASES)
def test_every_rank_gets_the_error(
    mismatched_runs: dict[tuple[str, str], Launched],
    strategy: str,
    mismatch: str,
    launcher: list[str],
) -> None:
    out, proc = mismatched_runs[strategy, mismatch]
    # a hang fails here, with the ranks' output; the ValueError on every rank below is the mismatch
    # found before any collective waits (not a collective's timeout)
    if isinstance(proc, AssertionError):
        raise proc
    log = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode != 0, log
    owner = OWNER.get(strategy, "HorovodAdasum")
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no outcome (killed before it got its error?)\n{log}"
        got = json.loads(path.read_text())
        assert got["type"] == "ValueError", (rank, got)
        assert got["message"].startswith(f"{owner}: the model differs between ranks"), (rank, got)
        assert EXPECTED[mismatch] in got["message"] and HINT in got["message"], (rank, got)
