"""Compressed strategy: 2 CPU processes over Gloo (parity with DDP, every compressor
training the workload, exact byte accounting, mixed precision, accumulation, Adasum, many buckets,
checkpoint resume), then Horovod's compression= under mpirun.

Optimizers: AdamW (lr 3e-3, the workload's default) for every compressor except DeMo, which is
plain SGD with the same Adam-sized lr: DeMo keeps the momentum itself and returns a sign update,
so SGD's step is lr * sign (see lightning_dist/compression/decoupled_momentum.py).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import MPIRUN_TWO_RANKS, SCRIPTS, assert_same_weights, max_abs_diff, run_in_sequence, run_script

from lightning_dist.compression import PowerSGD, make_compressor
from lightning_dist.workload import TinyCausalLM, WorkloadConfig

SCRIPT = str(SCRIPTS / "compressed_run.py")
STEPS = 200
WORKLOAD = {"train_bytes": 1_000_000}
"""The tiny model on 1 MB of text: 200 steps see 100 kB per rank, so validation loss tracks learning
(the tiny default of 40 kB overfits, and its validation loss stalls near the byte-unigram level)."""
TOLERANCE = {
    "fp16": 0.05,
    "bf16": 0.05,
    "int8": 0.05,
    "powersgd": 0.05,
    "topk": 0.10,
    "sign": 0.10,
    "demo": 0.10,
}


COMPRESS_FROM_THE_START = {"powersgd": {"warmup": 0}}
"""The options that keep a compressor compressing from the first step (PowerSGD's default
``warmup="auto"`` averages the first 10% of the steps uncompressed): the runs that test compression
itself (bytes, residuals, resume) pin it."""


# -- PowerSGD's warm-up, in this process -----------------------------------------------------------
def test_powersgd_defaults_warm_up_as_torch_advises() -> None:
    """``ld_compressed_powersgd`` and ``Compressed("powersgd")`` average the first 10% of the Trainer's
    steps uncompressed (torch's guidance for its PowerSGD hook); ``warmup=N`` sets it; compressors
    without a warm-up fraction, and PowerSGD with its own ``start_step``, start at once."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dist.strategies.compressed import AUTO_WARMUP_UNBOUNDED, Compressed

    named = StrategyRegistry.get("ld_compressed_powersgd")
    assert isinstance(named, Compressed) and isinstance(named.compressor, PowerSGD)
    assert named.warmup == Compressed("powersgd").warmup == "auto"

    def steps(total: float) -> Any:
        return SimpleNamespace(estimated_stepping_batches=total)

    assert named.resolve_warmup(steps(20)) == 2
    assert named.resolve_warmup(steps(95)) == 10  # rounded up
    assert named.resolve_warmup(steps(float("inf"))) == AUTO_WARMUP_UNBOUNDED
    assert Compressed(PowerSGD(rank=2)).resolve_warmup(steps(1000)) == 100
    assert Compressed("powersgd", warmup=5).resolve_warmup(steps(20)) == 5
    assert Compressed("powersgd", warmup=0).resolve_warmup(steps(20)) == 0
    assert Compressed("powersgd", start_step=3).resolve_warmup(steps(20)) == 0
    for other in ("none", "fp16", "int8", "topk"):
        assert Compressed(other).resolve_warmup(steps(20)) == 0, other


@pytest.mark.parametrize("bad", [-1, 1.5, True, "none", None])
def test_bad_warmup_is_refused_naming_what_is_accepted(bad: Any) -> None:
    from lightning_dist.strategies.compressed import Compressed

    with pytest.raises(ValueError, match=r"warmup=.* accepted: 'auto' or an integer >= 0"):
        Compressed("powersgd", warmup=bad)


# -- 2 processes over Gloo -------------------------------------------------------------------------
JOB_BUDGET = 200
"""Seconds for one `job` (the module fixture's runs, or the resume runs); each test that runs one
is marked `@pytest.mark.timeout(2 * JOB_BUDGET)`, so the budget is at most half its timeout."""


def job(out: Path, runs: list[dict[str, Any]]) -> Path:
    run_script([SCRIPT, "--out", str(out), "--runs", json.dumps(runs)], timeout=JOB_BUDGET)
    return out


def weights(out: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.rank{rank}.pt")


def info(out: Path, name: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def training_runs() -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = [{"name": "ddp", "strategy": "DDP"}, {"name": "none", "strategy": "none"}]
    runs += [
        {"name": c, "strategy": c, "options": dict(COMPRESS_FROM_THE_START.get(c, {}))}
        for c in TOLERANCE
        if c != "demo"
    ]
    runs.append({"name": "demo", "strategy": "demo", "optimizer": "sgd"})
    for r in runs:
        r.update(steps=STEPS, workload=WORKLOAD)
    runs[0]["snapshot_steps"] = [WARMUP_AUTO, WARMUP, WARMUP_STEPS]  # DDP's weights after those steps
    short = {"steps": 12, "validate": False}
    runs += [
        {"name": "ddp_acc", "strategy": "DDP", "accumulate": 2, **short},
        {"name": "none_acc", "strategy": "none", "accumulate": 2, **short},
        {"name": "ddp_adasum", "strategy": "DDP", "options": {"reduce_op": "adasum"}, **short},
        {"name": "none_adasum", "strategy": "none", "options": {"reduce_op": "adasum"}, **short},
        {"name": "bf16_adasum", "strategy": "bf16", "options": {"reduce_op": "adasum"}, **short},
        {
            "name": "powersgd_buckets_bf16",
            "strategy": "powersgd",
            "options": {"bucket_cap_mb": 0.01, "warmup": 0},
            "precision": "bf16-mixed",
            "accumulate": 2,
            **short,
        },
        {
            "name": "int8_buckets_fp16",
            "strategy": "int8",
            "options": {"bucket_cap_mb": 0.01},
            "precision": "16-mixed",
            **short,
        },
        {
            "name": "demo_buckets",
            "strategy": "demo",
            "options": {"bucket_cap_mb": 0.01},
            "optimizer": "sgd",
            **short,
        },
    ]
    # uncompressed references with the same precision, accumulation and buckets (see UNCOMPRESSED)
    runs += [
        {"name": "ddp_buckets_bf16", "strategy": "DDP", "options": {"bucket_cap_mb": 0.01},
         "precision": "bf16-mixed", "accumulate": 2, **short},
        {"name": "ddp_buckets_fp16", "strategy": "DDP", "options": {"bucket_cap_mb": 0.01},
         "precision": "16-mixed", **short},
        {"name": "demo_one_bucket", "strategy": "demo", "optimizer": "sgd", **short},
    ]  # fmt: skip
    runs.append(HOROVOD_REFERENCE)
    runs += warmup_runs()
    return runs


UNCOMPRESSED: dict[str, tuple[str, float, float]] = {
    "bf16_adasum": ("ddp_adasum", 0.005, 0.02),
    "powersgd_buckets_bf16": ("ddp_buckets_bf16", 0.05, 0.6),
    "int8_buckets_fp16": ("ddp_buckets_fp16", 0.02, 0.25),
    "demo_buckets": ("demo_one_bucket", 0.03, 1.0),
}
"""Short run -> (its reference, bound on |train loss / reference's - 1|, bound on the weights' distance
from the reference's over the reference's distance from the initial weights). Measured on 2026-11-30:
loss -0.00% / +1.6% / +0.3% / -0.5%, distance 0.004 / 0.35 / 0.10 / 0.64. The reference is the
uncompressed run with the same precision, accumulation and buckets (DeMo's: DeMo in one bucket, as
DeMo's sign update has no uncompressed twin); a run that did not train ends near ln(256), 35% off."""


WARMUP = 4
"""``Compressed("powersgd", warmup=WARMUP)``: steps averaged uncompressed before PowerSGD starts."""
WARMUP_STEPS = 8
WARMUP_AUTO = 2
"""``warmup="auto"`` on a 20-step run: 10% of it (torch's guidance for its PowerSGD hook)."""


def warmup_runs() -> list[dict[str, Any]]:
    """PowerSGD after an explicit warm-up, and with its defaults (as ``ld_compressed_powersgd``)."""
    common = {"strategy": "powersgd", "workload": WORKLOAD, "validate": False}
    return [
        {"name": "powersgd_warmup", "options": {"warmup": WARMUP}, "steps": WARMUP_STEPS,
         "snapshot_steps": [WARMUP], **common},
        {"name": "powersgd_auto", "steps": 20, "snapshot_steps": [WARMUP_AUTO], **common},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return job(tmp_path_factory.mktemp("trained"), training_runs())


def l2_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_none_is_bitwise_ddp(trained: Path) -> None:
    for ref, ours in (("ddp", "none"), ("ddp_acc", "none_acc"), ("ddp_adasum", "none_adasum")):
        for rank in (0, 1):
            assert_same_weights(weights(trained, ours, rank), weights(trained, ref, 0), atol=0)
    initial = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    assert max_abs_diff(initial, weights(trained, "ddp")) > 1e-2, "training changed the weights"


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_every_compressor_trains_close_to_uncompressed(trained: Path) -> None:
    ref = info(trained, "ddp")["val_loss"]
    assert ref < 0.55 * math.log(256), f"the uncompressed run must really train (val loss {ref:.3f})"
    report = []
    for name, tol in TOLERANCE.items():
        loss = info(trained, name)["val_loss"]
        report.append(f"{name}: {loss:.4f} ({loss / ref - 1:+.1%})")
        assert loss <= ref * (1 + tol), (
            f"{name}: val loss {loss:.4f} vs uncompressed {ref:.4f} (tolerance {tol:.0%})"
        )
        assert_same_weights(weights(trained, name, 1), weights(trained, name, 0), atol=0)
    print("uncompressed", ref, "; ".join(report))


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_bytes_per_step_match_wire_model_and_ratio_is_logged(trained: Path) -> None:
    shapes = [tuple(p.shape) for p in TinyCausalLM(WorkloadConfig.tiny(seed=7)).parameters()]
    for name in ["none", *TOLERANCE]:
        got = info(trained, name)
        (layout,) = got["layout"].values()  # one bucket: the model is small
        bucket = [shapes[i] for i in layout]
        compressor = make_compressor(name)
        expected = compressor.wire_bytes(bucket, 2)  # the rounds' shapes are known: nothing else is sent
        stats = got["stats"]
        assert stats["bytes_per_step"] == expected, name
        assert stats["reference_bytes"] == 4 * sum(math.prod(s) for s in shapes)  # ring at W=2: N bytes
        assert got["logged_ratio"] == pytest.approx(stats["bytes_per_step"] / stats["reference_bytes"])
        if name not in ("none", "fp16", "bf16"):
            assert stats["ratio"] < 0.3, name


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_mixed_precision_accumulation_adasum_and_many_buckets(trained: Path) -> None:
    initial = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    for name, (ref, loss_bound, distance_bound) in UNCOMPRESSED.items():
        got, expected = info(trained, name), info(trained, ref)
        assert got["global_step"] == expected["global_step"] == 12, name
        assert_same_weights(weights(trained, name, 1), weights(trained, name, 0), atol=0)
        loss_gap = got["train_loss"] / expected["train_loss"] - 1
        distance = l2_distance(weights(trained, name), weights(trained, ref)) / l2_distance(
            weights(trained, ref), initial
        )
        print(f"{name} vs {ref}: loss {loss_gap:+.2%}, relative weight distance {distance:.3f}")
        assert abs(loss_gap) <= loss_bound, (
            f"{name}: train loss {loss_gap:+.2%} off {ref} (bound {loss_bound:.0%})"
        )
        assert distance <= distance_bound, (
            f"{name}: weights {distance:.3f} from {ref} (bound {distance_bound})"
        )
    assert len(info(trained, "powersgd_buckets_bf16")["layout"]) > 2, (
        "bucket_cap_mb=0.01 gives several buckets"
    )
    # accumulation over 2 batches: one exchange per bucket per optimizer step (the first step has
    # DDP's single pre-rebuild bucket), not per batch
    got = info(trained, "powersgd_buckets_bf16")
    assert got["hook_calls"] == 1 + 11 * len(got["layout"])
    assert info(trained, "none_acc")["hook_calls"] == 12


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_powersgd_warmup_is_ddp_bitwise_then_compresses(trained: Path) -> None:
    """The warm-up steps are ``DDP()``'s, bitwise (weights after them, on both ranks); from the next
    step on every step sends PowerSGD's wire bytes; ``warmup="auto"`` is 10% of a 20-step run."""
    shapes = [tuple(p.shape) for p in TinyCausalLM(WorkloadConfig.tiny(seed=7)).parameters()]
    uncompressed = 4 * sum(math.prod(s) for s in shapes)  # a ring all-reduce at W=2 sends N bytes
    for name, warmup, steps in (
        ("powersgd_warmup", WARMUP, WARMUP_STEPS),
        ("powersgd_auto", WARMUP_AUTO, 20),
    ):
        got = info(trained, name)
        assert got["warmup_steps"] == warmup, name
        for rank in (0, 1):
            ddp = torch.load(trained / f"ddp.step{warmup}.rank0.pt")
            assert_same_weights(torch.load(trained / f"{name}.step{warmup}.rank{rank}.pt"), ddp, atol=0)
        (layout,) = got["layout"].values()
        compressed = PowerSGD().wire_bytes([shapes[i] for i in layout], 2)
        assert got["step_bytes"] == [uncompressed] * warmup + [compressed] * (steps - warmup), name
        assert compressed < 0.3 * uncompressed
        assert_same_weights(weights(trained, name, 1), weights(trained, name, 0), atol=0)
    ddp_after = torch.load(trained / f"ddp.step{WARMUP_STEPS}.rank0.pt")
    drift = max_abs_diff(weights(trained, "powersgd_warmup"), ddp_after)
    assert drift > 1e-5, f"the steps after the warm-up must be compressed (max diff from DDP()'s {drift})"


@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_checkpoint_resume_continues_exactly(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "epoch1.ckpt")
    ckpt_warmup = str(tmp_path / "warmup_epoch1.ckpt")
    base = {
        "strategy": "powersgd",
        "batches_per_epoch": 5,
        "validate": False,
        "options": {"bucket_cap_mb": 0.01, "warmup": 0},
    }
    warmup = {**base, "options": {"bucket_cap_mb": 0.01, "warmup": 7}}
    out = job(
        tmp_path,
        [
            {"name": "full", "epochs": 2, **base},
            {"name": "first", "epochs": 1, "save": ckpt, **base},
            {"name": "resumed", "epochs": 2, "resume": ckpt, **base},
            {"name": "dropped", "epochs": 2, "resume": ckpt, "drop_compressor_state": True, **base},
            # stopped inside the warm-up (after step 5 of 7), resumed: the warm-up ends where it would have
            {"name": "full_warmup", "epochs": 2, **warmup},
            {"name": "first_warmup", "epochs": 1, "save": ckpt_warmup, **warmup},
            {"name": "resumed_warmup", "epochs": 2, "resume": ckpt_warmup, **warmup},
        ],
    )
    saved = torch.load(ckpt, weights_only=False)["lightning_dist.compressed"]
    assert saved["compressor"] == "powersgd" and saved["world_size"] == 2 and len(saved["ranks"]) == 2
    r0, r1 = (entry["state"]["keys"] for entry in saved["ranks"])
    assert r0.keys() == r1.keys() and len(r0) > 2
    assert any(
        not torch.equal(r0[k]["residual"][g], r1[k]["residual"][g]) for k in r0 for g in r0[k]["residual"]
    ), "residuals differ per rank, so each rank must get its own back"
    assert info(out, "full")["global_step"] == info(out, "resumed")["global_step"] == 10
    for rank in (0, 1):
        assert_same_weights(weights(out, "resumed", rank), weights(out, "full", rank), atol=1e-6)
    assert info(out, "resumed")["layout"] == info(out, "full")["layout"]
    drift = max_abs_diff(weights(out, "dropped"), weights(out, "full"))
    assert drift > 1e-4, f"resuming without the compressor state should differ (max diff {drift})"
    for rank in (0, 1):
        assert_same_weights(
            weights(out, "resumed_warmup", rank), weights(out, "full_warmup", rank), atol=1e-6
        )
    full, resumed = info(out, "full_warmup")["step_bytes"], info(out, "resumed_warmup")["step_bytes"]
    assert resumed == full[5:] and full[6] > 3 * full[7], "steps 5, 6 uncompressed, PowerSGD from step 7"


# -- Horovod compression= ---------------------------------------------------------------------------
HOROVOD_COMPRESSIONS = ("none", "fp16", "bf16")
HOROVOD_REFERENCE = {"name": "ddp_for_horovod", "strategy": "DDP", "lr": 6e-3, "steps": 12, "validate": False}
"""compressed_hvd.py's run under DDP(): AdamW at 2 x 3e-3 (Horovod's average scales the learning
rate by the world size), batch 8 per rank, 12 steps; it is in the `trained` fixture's launch."""
HOROVOD_ATOL = 1e-5
"""Horovod(compression="none") against DDP(): the same gradients and steps, summed in another order."""
HOROVOD_BOUND = 0.02
"""How far fp16/bf16 may end from the uncompressed Horovod run: the weights' L2 distance over the
uncompressed run's distance from the initial weights (measured: fp16 0.0005, bf16 0.0033)."""


@pytest.fixture(scope="module")
def horovod_compression(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """compressed_hvd.py with each of ``HOROVOD_COMPRESSIONS``, one after another in one mpirun launch."""
    pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    root = tmp_path_factory.mktemp("horovod")
    mpirun = [*MPIRUN_TWO_RANKS, sys.executable]
    runs = [["compressed_hvd.py", "--compression", c, "--out", str(root / c)] for c in HOROVOD_COMPRESSIONS]
    run_in_sequence(runs, JOB_BUDGET, launcher=mpirun)
    return root


@pytest.mark.slow
@pytest.mark.horovod
@pytest.mark.timeout(2 * JOB_BUDGET)
def test_horovod_compression_trains_under_mpirun(horovod_compression: Path, trained: Path) -> None:
    results = {}
    for compression in HOROVOD_COMPRESSIONS:
        out = horovod_compression / compression
        w0, w1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
        assert_same_weights(w0, w1, atol=0)
        got = json.loads((out / "rank0.json").read_text())
        assert got["world_size"] == 2 and got["global_step"] == 12
        results[compression] = (w0, got)
    uncompressed = results["none"][0]
    reference = weights(trained, HOROVOD_REFERENCE["name"])
    assert max_abs_diff(uncompressed, reference) < HOROVOD_ATOL, "Horovod's average must be DDP()'s"
    initial = TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()
    losses = {c: r[1]["losses"] for c, r in results.items()}
    for c in ("fp16", "bf16"):
        assert sum(losses[c][-3:]) < sum(losses[c][:3]) - 0.6, f"{c}: loss did not fall: {losses[c]}"
        assert abs(losses[c][-1] - losses["none"][-1]) < 0.05 * losses["none"][-1]
        assert max_abs_diff(results[c][0], uncompressed) > 0, f"{c}: gradients were not rounded"
        distance = l2_distance(results[c][0], uncompressed) / l2_distance(uncompressed, initial)
        print(f"Horovod {c}: relative weight distance {distance:.4f} from uncompressed")
        assert distance <= HOROVOD_BOUND, (
            f"{c}: weights {distance:.4f} from uncompressed (bound {HOROVOD_BOUND})"
        )
    grad_bytes = {
        c: r[1]["stats"].get("all_reduce.bytes_sent", 0) + r[1]["stats"].get("all_gather.bytes_sent", 0)
        for c, r in results.items()
    }
    assert grad_bytes["fp16"] < 0.55 * grad_bytes["none"] and grad_bytes["bf16"] < 0.55 * grad_bytes["none"]
