"""Horovod and HorovodAdasum strategies under horovodrun/mpirun with 2 CPU ranks (MPI controller)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, load_rank, max_abs_diff, run_command, run_in_sequence
from references import adasum_pair, local_gradients, optimizer_update, update_space_adasum

from lightning_dist.workload import TinyCausalLM, WorkloadConfig

pytestmark = [pytest.mark.slow, pytest.mark.horovod]  # and the timeout below

hvd = pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found (apt-get install openmpi-bin)", allow_module_level=True)

BUDGET = 200
"""Seconds for the horovodrun launch below (one Horovod run takes about 15 s on 2 shared cores): each
test is marked `@pytest.mark.timeout(2 * BUDGET)`. The mpirun runs and the "ddp" references are
tests/shared_runs.py's (``shared_mpirun``, ``shared_popen``)."""
LR = 3e-3
"""hvd_train.py's AdamW learning rate (weight decay 0.01)."""
ATOL = 1e-5
"""Horovod's average against Lightning's "ddp": the same gradients and steps, summed in another order."""

pytestmark.append(pytest.mark.timeout(2 * BUDGET))


def mpirun(
    np: int, script: str, *args: str, check: bool = True, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    cmd = [*helpers.mpirun_ranks(np), sys.executable, script, *args]
    proc = run_command(cmd, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def horovodrun_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Under ``horovodrun --mpi -np 2``, in one launch: HorovodAdasum for 12 steps, keeping each
    rank's batches ("adasum"), then one Adam step ("step", lr 0.01)."""
    root = tmp_path_factory.mktemp("horovodrun")
    runs = [
        ["hvd_train.py", "--strategy", "horovod_adasum", "--max-steps", "12", "--record-batches",
         "--out", str(root / "adasum")],
        ["one_step.py", "--strategy", "horovod_adasum", "--devices", "1", "--optimizer", "adam",
         "--lr", "0.01", "--out", str(root / "step")],
    ]  # fmt: skip
    run_in_sequence(
        runs,
        BUDGET,
        launcher=["horovodrun", "--mpi", "-np", "2", sys.executable],
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    return root


def assert_in_sync(out: Path) -> dict[str, torch.Tensor]:
    """Both ranks of the run in ``out`` at world size 2 end on the same weights; rank 0's."""
    w0, info0 = load_rank(out, 0)
    w1, _ = load_rank(out, 1)
    assert info0["world_size"] == 2
    assert_same_weights(w0, w1, atol=0)
    return w0


def assert_trained_and_in_sync(out: Path) -> dict[str, torch.Tensor]:
    """``assert_in_sync``, and the ranks' mean loss fell; rank 0's weights."""
    w0 = assert_in_sync(out)
    info0, info1 = (load_rank(out, r)[1] for r in (0, 1))
    losses = [(a + b) / 2 for a, b in zip(info0["losses"], info1["losses"])]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, f"loss did not fall: {losses}"
    return w0


def test_horovod_adasum_trains_under_horovodrun(horovodrun_runs: Path) -> None:
    """12 AdamW steps: the weights equal HorovodAdasum written out on one process
    (references.update_space_adasum: each rank's own AdamW step, the updates combined by Adasum)."""
    out = horovodrun_runs / "adasum"
    final = assert_trained_and_in_sync(out)
    _, info = load_rank(out, 0)
    assert info["lr_scale"] == 1.0, "Adasum on CPU does not scale the learning rate"
    assert info["stats"]["adasum.calls"] == 12, "one Adasum of the updates per optimizer step"
    start = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    batches = [torch.load(out / f"rank{r}.batches.pt") for r in (0, 1)]
    assert len(batches[0]) == 12 and not torch.equal(batches[0][0][0], batches[1][0][0])
    expected = update_space_adasum(start, batches, LR, weight_decay=0.01)
    final = {n: final[n] for n in expected}
    assert max_abs_diff(final, start) > 1e-2, "12 steps must move the weights"
    assert max_abs_diff(final, expected) < 1e-6, f"off the reference by {max_abs_diff(final, expected)}"


def test_horovod_adasum_one_adam_step_combines_the_updates(horovodrun_runs: Path) -> None:
    """p1 = p0 + Adasum(delta_0, delta_1), delta_r being Adam's update from rank r's own gradient."""
    out, lr = horovodrun_runs / "step", 0.01
    ranks = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    start = ranks[0]["start"]
    g0, g1 = (local_gradients(start, r["batch"]) for r in ranks)
    d0, d1 = (optimizer_update(start, g, "adam", lr) for g in (g0, g1))
    expected = {n: start[n] + adasum_pair(d0[n], d1[n]).float() for n in g0}
    combined = {n: adasum_pair(g0[n], g1[n]).float() for n in g0}
    gradient_space = {n: start[n] + d for n, d in optimizer_update(start, combined, "adam", lr).items()}
    for r in ranks:
        final = {n: r["final"][n] for n in g0}
        assert max_abs_diff(final, expected) < 1e-6, (
            f"off the update-space reference by {max_abs_diff(final, expected)}"
        )
        assert max_abs_diff(final, gradient_space) > 1e-4, (
            "gradient-space Adasum would pass too: the test is blind"
        )


def test_horovod_average_trains_and_matches_lightning_ddp_with_clipping(
    shared_mpirun: dict[str, Path], shared_popen: dict[str, Path]
) -> None:
    w_ref, _ = load_rank(shared_popen["ddp_clip"], 0)
    w0 = assert_in_sync(shared_mpirun["hvd_clip"])
    assert max_abs_diff(w0, w_ref) < ATOL
    unclipped = shared_mpirun["hvd_noclip"]
    assert max_abs_diff(load_rank(unclipped, 0)[0], w0) > 1e-4, "clipping at 0.05 must change the result"


def test_horovod_average_with_auto_lr_scale_equals_lightning_ddp_at_twice_the_lr(
    shared_mpirun: dict[str, Path], shared_popen: dict[str, Path]
) -> None:
    """Horovod's average with ``lr_scale="auto"`` (the world size, 2) is Lightning's "ddp" at 2 x lr
    (``shared_popen["ddp_lr_x2"]``: lr 0.006)."""
    out = shared_mpirun["hvd_auto_lr"]
    assert load_rank(out, 0)[1]["lr_scale"] == 2.0, "Average scales the learning rate by the world size"
    w0 = assert_trained_and_in_sync(out)
    reference, _ = load_rank(shared_popen["ddp_lr_x2"], 0)
    assert max_abs_diff(w0, reference) < ATOL, f"off Lightning's ddp by {max_abs_diff(w0, reference)}"
    start = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    assert max_abs_diff(w0, start) > 1e-2, "12 steps must move the weights"


@pytest.mark.parametrize("strategy", ["horovod", "horovod_adasum"])
def test_accumulation_equals_doubled_batch(shared_mpirun: dict[str, Path], strategy: str) -> None:
    accumulated, doubled = shared_mpirun[f"hvd_acc-{strategy}"], shared_mpirun[f"hvd_big-{strategy}"]
    w_acc, info = load_rank(accumulated, 0)
    w_big, _ = load_rank(doubled, 0)
    assert info["global_step"] == 5
    assert max_abs_diff(w_acc, w_big) < 1e-5
    calls = (
        info["stats"]["adasum.calls"] if strategy == "horovod_adasum" else info["stats"]["all_reduce.calls"]
    )
    big_calls = load_rank(doubled, 0)[1]["stats"]
    assert calls == (
        big_calls["adasum.calls"] if strategy == "horovod_adasum" else big_calls["all_reduce.calls"]
    ) + (0 if strategy == "horovod_adasum" else 5), (
        "accumulation adds no gradient communication (only the 5 extra train_loss syncs)"
    )


def test_torchmetrics_and_sync_dist_under_horovod(shared_mpirun: dict[str, Path]) -> None:
    import torchmetrics

    got = json.loads(shared_mpirun["hvd_metrics.json"].read_text())
    sys.path.insert(0, str(SCRIPTS))
    from metric_run import CLASSES, N, dataset  # type: ignore[import-not-found]

    logits, target = dataset().tensors
    expected = torchmetrics.functional.accuracy(
        logits, target, task="multiclass", num_classes=CLASSES, average="micro"
    )
    assert got["seen_rank0"] == N // 2
    assert got["acc"] == pytest.approx(float(expected), abs=1e-6)
    assert got["rank_plus_one"] == pytest.approx(1.5)


def test_adasum_refuses_gloo_controller_on_every_rank(tmp_path: Path) -> None:
    cmd = ["horovodrun", "--gloo", "-np", "2", sys.executable, str(SCRIPTS / "hvd_train.py")]
    proc = run_command([*cmd, "--strategy", "horovod_adasum", "--out", str(tmp_path / "x")], 120)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert text.count("needs the MPI controller") >= 2, text[-3000:]
    assert "DDP(reduce_op='adasum')" in text


@pytest.mark.parametrize(
    ("np", "flags", "expected"),
    [
        (3, [], ["power-of-two world size; got 3", "DDP(reduce_op='adasum')"]),
        (2, ["--precision", "16-true"], ["precision='16-true' is not supported with op='adasum'"]),
    ],
)
def test_adasum_refuses_what_it_cannot_run(
    tmp_path: Path, np: int, flags: list[str], expected: list[str]
) -> None:
    script = str(SCRIPTS / "hvd_train.py")
    out = str(tmp_path / "x")
    proc = mpirun(np, script, "--strategy", "horovod_adasum", *flags, "--out", out, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    for phrase in expected:
        assert phrase in text, text[-3000:]
