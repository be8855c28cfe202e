"""The collectives a LightningModule or callback reaches through a strategy, on 2 CPU processes, equal
to Lightning's own DDPStrategy on the same module (tests/scripts/collective_contract.py lists them).

Two differences are deliberate (docs/lightning-compat.md): an integer tensor's mean comes back as the
exact float mean, where Lightning truncates it into the integer tensor; a group that is not all of
the strategy's ranks is refused (tests/test_strategy_options.py), where Lightning reduces over it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import MPIRUN_TWO_RANKS, run_in_sequence

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = "collective_contract.py"
BUDGET = 120
LAUNCH = {
    "DDP": "lightning",
    "Compressed": "lightning",
    "DiLoCo": "lightning",
    "Elastic": "torchrun",
    "FaultTolerant": "torchft",
    "ElasticDiLoCo": "torchrun",
    "Horovod": "mpirun",
    "HorovodAdasum": "mpirun",
}
"""Every strategy of the pack, with the launcher its users start it with."""
DIFFERS = {"reduce_int_mean"}


def launch(root: Path, strategies: list[str], how: str) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The contract with each of ``strategies``, one after another in one launch of kind ``how``;
    each strategy's per-rank results."""
    launcher = [sys.executable]
    if how == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    elif how == "torchft":
        pytest.importorskip("torchft", reason="torchft not installed (pip install '.[ft]')")
        launcher = [sys.executable, "-m", "lightning_dist.launch.fault_tolerant", "--groups", "2", "--"]
    elif how == "mpirun":
        if shutil.which("mpirun") is None:
            pytest.skip("mpirun not found (apt-get install openmpi-bin)")
        pytest.importorskip("horovod.torch", reason="Horovod not installed (lightning-dist install-horovod)")
        launcher = [*MPIRUN_TWO_RANKS, sys.executable]
    runs = [[SCRIPT, "--strategy", strategy, "--out", str(root / strategy)] for strategy in strategies]
    run_in_sequence(runs, BUDGET, launcher)
    return {s: [torch.load(root / s / f"rank{rank}.pt") for rank in (0, 1)] for s in strategies}


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Lightning's "ddp" (the reference) and the pack strategies Lightning launches, in one launch."""
    names = ["ddp", *(s for s, how in LAUNCH.items() if how == "lightning")]
    return launch(tmp_path_factory.mktemp("lightning"), names, "lightning")


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, torch.Tensor]]]:
    names = [s for s, how in LAUNCH.items() if how == "torchrun"]
    return launch(tmp_path_factory.mktemp("torchrun"), names, "torchrun")


@pytest.fixture(scope="module")
def mpirun_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, torch.Tensor]]]:
    names = [s for s, how in LAUNCH.items() if how == "mpirun"]
    return launch(tmp_path_factory.mktemp("mpirun"), names, "mpirun")


@pytest.fixture(scope="module")
def torchft_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, torch.Tensor]]]:
    """FaultTolerant's two replica groups of one process each (its ranks: the quorum's)."""
    return launch(tmp_path_factory.mktemp("torchft"), ["FaultTolerant"], "torchft")


@pytest.fixture(scope="module")
def lightning_ddp(lightning_runs: dict[str, list[dict[str, torch.Tensor]]]) -> list[dict[str, torch.Tensor]]:
    return lightning_runs["ddp"]


def test_reference_sees_what_the_contract_expects(lightning_ddp: list[dict[str, torch.Tensor]]) -> None:
    """The reference itself, checked by hand: the contract compares against real values."""
    r0, r1 = lightning_ddp
    assert r0["gather_vector"].tolist() == r1["gather_vector"].tolist() == [[0, 1, 2], [10, 11, 12]]
    assert r0["gather_scalar"].tolist() == [1.0, 2.0]
    assert r0["nested_b1_1"].tolist() == [0, 1]
    # rank r's weights are arange(4).reshape(2, 2) * (r + 1): rank r's leaf gets row r of their sum
    assert r0["gather_grad"].tolist() == [0 + 0, 1 + 2] and r1["gather_grad"].tolist() == [2 + 4, 3 + 6]
    assert r0["reduce_sum"].tolist() == [10, 12, 14] and r0["reduce_mean"].tolist() == [5, 6, 7]
    assert r0["reduce_source_after"].tolist() == [10, 12, 14], "Lightning reduces in place"
    assert r1["broadcast_0"].tolist() == [0, 1, 2] and r0["broadcast_1"].item() == 1
    assert r0["decision_all"].item() is False and r1["decision_any"].item() is True
    assert r0["metric_log_sum"].item() == 3.0 and r1["metric_log_max"].item() == 2.0
    assert r0["metric_log_world"].item() == 15.0
    assert r0["metric_log_local"].item() == 1.0 and r1["metric_log_local"].item() == 2.0
    assert r0["reduce_int_mean"].dtype == torch.int64 and r0["reduce_int_mean"].tolist() == [2, 5]


@pytest.mark.parametrize("strategy", sorted(LAUNCH))
def test_collectives_equal_lightning_ddp(
    request: pytest.FixtureRequest, strategy: str, lightning_ddp: list[dict[str, torch.Tensor]]
) -> None:
    ours = request.getfixturevalue(f"{LAUNCH[strategy]}_runs")[strategy]
    for rank, (got, ref) in enumerate(zip(ours, lightning_ddp, strict=True)):
        own = {k for k in got if k.startswith("pack_")}
        if LAUNCH[strategy] not in ("mpirun", "torchft"):  # a torch.distributed world: groups can be named
            assert got.pop("pack_subgroup_refused").item() is True, "a subgroup must be refused"
            torch.testing.assert_close(
                got.pop("pack_reduce_all_ranks_group"), ref["reduce_sum"], rtol=0, atol=0
            )
        assert not (own - {"pack_subgroup_refused", "pack_reduce_all_ranks_group"}), own
        assert got.keys() == ref.keys(), f"rank {rank}: {sorted(got.keys() ^ ref.keys())}"
        for key in sorted(ref.keys() - DIFFERS):
            a, b = got[key], ref[key]
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f"rank {rank} {key}: {a!r} != {b!r}"
            assert torch.equal(a, b), f"rank {rank} {key}: {a.tolist()} != {b.tolist()}"
        # the exact mean of [rank + 2, 5] over ranks 0 and 1 (Lightning: truncated into int64)
        assert got["reduce_int_mean"].tolist() == [2.5, 5.0]


def test_fault_tolerant_sync_dist_log_is_the_mean_over_groups(
    torchft_runs: dict[str, list[dict[str, torch.Tensor]]],
) -> None:
    """``self.log(..., sync_dist=True)`` in a FaultTolerant run is the mean over the quorum's groups of
    what each logged: group r logs (r + 1) x (batch_idx + 1), the last batch's index being 1, and
    ``log_local`` (no sync) keeps each group's r + 1."""
    runs = torchft_runs["FaultTolerant"]
    local = [run["metric_log_local"].item() for run in runs]
    assert local == [1.0, 2.0], "each group logs its own value unsynced"
    expected = sum(value * 2 for value in local) / len(local)
    for run in runs:
        assert run["metric_log_mean"].item() == expected
        assert run["metric_log_sum"].item() == sum(local) and run["metric_log_max"].item() == max(local)
