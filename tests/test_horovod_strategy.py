"""Horovod and HorovodAdasum strategies under horovodrun/mpirun with 2 CPU ranks (MPI controller)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, assert_same_weights, load_rank, max_abs_diff, run_command, run_script
from references import adasum_pair, local_gradients, optimizer_update

pytestmark = [pytest.mark.slow, pytest.mark.horovod]

hvd = pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found (apt-get install openmpi-bin)", allow_module_level=True)

ROOT_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def mpirun(
    np: int, script: str, *args: str, check: bool = True, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    cmd = [
        "mpirun",
        "-np",
        str(np),
        *ROOT_FLAGS,
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        script,
        *args,
    ]
    proc = run_command(cmd, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def hvd_fit(tmp_path: Path, name: str, *args: str, np: int = 2) -> Path:
    out = tmp_path / name
    mpirun(np, str(SCRIPTS / "hvd_train.py"), "--out", str(out), *args)
    return out


def assert_trained_and_in_sync(out: Path) -> None:
    w0, info0 = load_rank(out, 0)
    w1, info1 = load_rank(out, 1)
    assert info0["world_size"] == 2
    assert_same_weights(w0, w1, atol=0)
    losses = [(a + b) / 2 for a, b in zip(info0["losses"], info1["losses"])]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, f"loss did not fall: {losses}"


def test_horovod_adasum_trains_under_horovodrun(tmp_path: Path) -> None:
    out = tmp_path / "adasum"
    cmd = ["horovodrun", "--mpi", "-np", "2", sys.executable, str(SCRIPTS / "hvd_train.py")]
    proc = run_command(
        [*cmd, "--strategy", "horovod_adasum", "--max-steps", "12", "--out", str(out)],
        120,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_trained_and_in_sync(out)
    _, info = load_rank(out, 0)
    assert info["lr_scale"] == 1.0, "Adasum on CPU does not scale the learning rate"
    assert info["stats"]["adasum.calls"] == 12, "one Adasum of the updates per optimizer step"


def test_horovod_adasum_one_adam_step_combines_the_updates(tmp_path: Path) -> None:
    """p1 = p0 + Adasum(delta_0, delta_1), delta_r being Adam's update from rank r's own gradient."""
    out, lr = tmp_path / "step", 0.01
    cmd = ["horovodrun", "--mpi", "-np", "2", sys.executable, str(SCRIPTS / "one_step.py")]
    proc = run_command(
        [*cmd, "--strategy", "horovod_adasum", "--devices", "1", "--optimizer", "adam", "--lr", str(lr),
         "--out", str(out)],
        200,
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
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


def test_horovod_average_trains_and_matches_lightning_ddp_with_clipping(tmp_path: Path) -> None:
    ours = hvd_fit(
        tmp_path, "hvd", "--strategy", "horovod", "--lr-scale", "1", "--clip", "0.05", "--max-steps", "6"
    )
    ref = tmp_path / "ddp"
    run_script(
        [
            str(SCRIPTS / "ddp_run.py"),
            "--strategy",
            "ddp",
            "--clip",
            "0.05",
            "--max-steps",
            "6",
            "--out",
            str(ref),
        ],
        timeout=90,
    )
    w_ref, _ = load_rank(ref, 0)
    w0, info0 = load_rank(ours, 0)
    w1, _ = load_rank(ours, 1)
    assert_same_weights(w0, w1, atol=0)
    assert max_abs_diff(w0, w_ref) < 1e-5
    unclipped = hvd_fit(tmp_path, "noclip", "--strategy", "horovod", "--lr-scale", "1", "--max-steps", "6")
    assert max_abs_diff(load_rank(unclipped, 0)[0], w0) > 1e-4, "clipping at 0.05 must change the result"


def test_horovod_average_loss_falls_with_auto_lr_scale(tmp_path: Path) -> None:
    out = hvd_fit(tmp_path, "avg", "--strategy", "horovod", "--max-steps", "12")
    assert_trained_and_in_sync(out)
    assert load_rank(out, 0)[1]["lr_scale"] == 2.0, "Average scales the learning rate by the world size"


@pytest.mark.parametrize("strategy", ["horovod", "horovod_adasum"])
def test_accumulation_equals_doubled_batch(tmp_path: Path, strategy: str) -> None:
    accumulated = hvd_fit(
        tmp_path, "acc", "--strategy", strategy, "--accumulate", "2", "--optimizer", "sgd", "--max-steps", "5"
    )
    doubled = hvd_fit(
        tmp_path, "big", "--strategy", strategy, "--batch-size", "8", "--optimizer", "sgd", "--max-steps", "5"
    )
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


def test_torchmetrics_and_sync_dist_under_horovod(tmp_path: Path) -> None:
    import torchmetrics

    out = tmp_path / "metrics.json"
    mpirun(2, str(SCRIPTS / "metric_run.py"), "--strategy", "horovod", "--devices", "1", "--out", str(out))
    got = json.loads(out.read_text())
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
