"""DiLoCo: argument checks and the outer step (fast), then 2 CPU processes over Gloo against references:
DDP (H=1, outer SGD lr 1, no momentum, inner SGD), a single-process DiLoCo written in
tests/references.py (H=4, AdamW, Nesterov), an uninterrupted run (resume mid-period), the wire
model (bytes per optimizer step = 1/H of the pseudo-gradient exchange), and the tail (a fit that ends
inside a period: every rank on the same weights, the final checkpoint's, by a hand-computed outer step)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import references
import torch
from helpers import SCRIPTS, assert_same_weights, bad_integers, max_abs_diff, run_script
from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist import DiLoCo
from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.compression import Int8Quantization, PowerSGD, ring_all_reduce_bytes
from lightning_dist.strategies.diloco import CHECKPOINT_KEY
from lightning_dist.strategies.options import DILOCO_COMPRESSIONS
from lightning_dist.workload import TinyCausalLM, WorkloadConfig

SCRIPT = str(SCRIPTS / "diloco_run.py")
LR, WEIGHT_DECAY = 3e-3, 0.01  # the script's AdamW


# -- fast: arguments, registry, the outer step -----------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        *bad_integers("inner_steps"),
        ({"outer_lr": 0}, "outer_lr=0 must be a number > 0"),
        ({"outer_lr": float("nan")}, "outer_lr=nan must be a number > 0"),
        ({"outer_momentum": -0.1}, r"outer_momentum=-0.1 must be in \[0, 1\)"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0 must be in \[0, 1\)"),
        ({"nesterov": 1}, "nesterov=1 must be True or False"),
        ({"sync_buffers": None}, "sync_buffers=None must be True or False"),
        (
            {"compression": "powersgd"},
            "compression='powersgd' is not supported by DiLoCo.*accepted: None, 'none'",
        ),
        ({"compression": "topk"}, "compression='topk' is not supported by DiLoCo"),
        ({"compression": 8}, "compression=8 is not supported by DiLoCo"),
        ({"compression": PowerSGD()}, r"compression=PowerSGD\(.*is not supported by DiLoCo"),
        ({"start_method": "thread"}, "start_method='thread' is not supported"),
        ({"reduce_op": "adasum"}, "DiLoCo got unknown option.*reduce_op.*accepted: inner_steps"),
        ({"inner_step": 4}, "DiLoCo got unknown option.*inner_step;"),
    ],
)
def test_bad_arguments_fail_early_naming_them(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DiLoCo(**kwargs)


def test_accepted_arguments_and_registered_names() -> None:
    for compression in (None, *DILOCO_COMPRESSIONS, "INT8", Int8Quantization(chunk_size=64)):
        DiLoCo(inner_steps=3, compression=compression)
    d = DiLoCo(inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    assert (d.inner_steps, d.outer_lr, d.outer_momentum, d.nesterov) == (1, 1.0, 0.0, True)
    assert StrategyRegistry["ld_diloco"]["strategy"] is DiLoCo
    for name in ("fp16", "bf16", "int8"):
        assert StrategyRegistry[f"ld_diloco_{name}"]["init_params"] == {"compression": name}


def test_outer_step_is_nesterov_sgd_on_the_last_sync_params() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    b = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))  # last-sync copy kept in fp32
    start = {"w": w.detach().clone().double(), "b": b.detach().float().double()}
    outer = OuterSGD([("w", w), ("b", b)], lr=0.7, momentum=0.9, nesterov=True)
    assert outer.anchors[1].dtype == torch.float32
    anchor, buf = dict(start), dict[str, torch.Tensor]()
    for step in range(3):
        with torch.no_grad():
            w.sub_(0.01 * (step + 1))
            b.add_(0.25)
        deltas = outer.pseudo_gradients()
        outer.step(deltas)
        for (n, a), d in zip(list(anchor.items()), deltas, strict=True):
            buf[n] = 0.9 * buf[n] + d.double() if n in buf else d.double()
            anchor[n] = a - 0.7 * (d.double() + 0.9 * buf[n])
    torch.testing.assert_close(w.detach().double(), anchor["w"], rtol=0, atol=1e-6)
    torch.testing.assert_close(outer.anchors[1].double(), anchor["b"], rtol=0, atol=1e-5)
    state = outer.state_dict()
    fresh = OuterSGD([("w", w), ("b", b)], lr=0.7, momentum=0.9, nesterov=True)
    fresh.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(fresh.anchors, outer.anchors, strict=True))
    with pytest.raises(ValueError, match="other parameters"):
        OuterSGD([("v", w)], lr=0.7, momentum=0.9, nesterov=True).load_state_dict(state)
    # no momentum: nesterov is plain SGD (torch refuses nesterov without momentum)
    plain = OuterSGD([("w", w)], lr=1.0, momentum=0.0, nesterov=True)
    with torch.no_grad():
        w.add_(1.0)
    plain.step(plain.pseudo_gradients())
    assert torch.equal(plain.anchors[0], w.detach())


def test_the_tail_sync_runs_before_the_callbacks_that_save() -> None:
    """TailSync goes just before the first ModelCheckpoint (Lightning runs those last) or the
    strategy's own callback (its commits), whichever comes first; at the end without either; once."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dist.strategies.diloco_tail import TailSync, install_tail_sync

    class Own(L.Callback):
        def __init__(self, strategy: Any) -> None:
            self.strategy = strategy

    strategy, other = DiLoCo(inner_steps=2), DiLoCo(inner_steps=2)
    user, checkpoint = L.Callback(), ModelCheckpoint()
    for callbacks, expected in (
        ([user, Own(other), checkpoint], 2),
        ([user, checkpoint, Own(strategy)], 1),
        ([user, Own(strategy), checkpoint], 1),
        ([user], 1),
    ):
        trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False)
        trainer.callbacks = list(callbacks)
        install_tail_sync(trainer, strategy)
        install_tail_sync(trainer, strategy)
        tails = [i for i, c in enumerate(trainer.callbacks) if isinstance(c, TailSync)]
        assert tails == [expected] and trainer.callbacks[expected].strategy is strategy


# -- 2 processes over Gloo -----------------------------------------------------------------------
def weights(out: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.rank{rank}.pt")


def info(out: Path, name: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def same_tree(a: Any, b: Any) -> bool:
    """Equal nested dicts/lists with bitwise-equal tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def initial_weights() -> dict[str, torch.Tensor]:
    return TinyCausalLM(WorkloadConfig.tiny(seed=7)).state_dict()


H4 = {"inner_steps": 4}
RESUME = {"options": H4, "batches_per_epoch": 6}
"""6 optimizer steps per epoch with H=4: the end of epoch 1 is inner step 2 of the second period."""
TAIL = {"options": H4, "checkpoint": {}}
"""Fits of 6 optimizer steps with H=4 (a sync at 4, a tail of 2) and a ModelCheckpoint(save_last=True)."""


FIXTURE_BUDGET = 240
"""Seconds for the `trained` fixture's runs, in the first test that asks for it: each such test is
marked `@pytest.mark.timeout(2 * FIXTURE_BUDGET)`, so the budget is at most half its timeout."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("diloco")
    ckpt = str(out / "epoch1.ckpt")
    runs: list[dict[str, Any]] = [
        {"name": "ddp_sgd", "strategy": "DDP", "optimizer": "sgd", "steps": 6},
        {
            "name": "h1_sgd",
            "optimizer": "sgd",
            "steps": 6,
            "options": {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
        },
        {"name": "h4_one_sync", "options": H4, "steps": 4, "record_batches": True},
        {"name": "h4", "options": H4, "steps": 8, "record_batches": True},
        {"name": "int8", "options": {**H4, "compression": "int8"}, "steps": 8},
        {
            "name": "bf16_acc",
            "options": {"inner_steps": 2},
            "steps": 4,
            "accumulate": 2,
            "precision": "bf16-mixed",
            "validate": True,
        },
        {
            "name": "fp16",
            "options": {"inner_steps": 2, "compression": "fp16"},
            "steps": 4,
            "precision": "16-mixed",
        },
        {"name": "buffer", "options": {"inner_steps": 2}, "steps": 4, "buffer": True, "record_batches": True},
        {"name": "full", "epochs": 2, "save": ckpt, "save_at_epoch": 0, **RESUME},
        {"name": "resumed", "epochs": 2, "resume": ckpt, **RESUME},
        {"name": "dropped", "epochs": 2, "resume": ckpt, "drop_diloco_state": True, **RESUME},
        # the tail: max_steps (last.ckpt written at on_train_end), max_epochs, a should_stop
        {"name": "tail", **TAIL, "steps": 6, "checkpoint": {"save_top_k": 0}, "record_tail": True},
        {"name": "epoch_tail", **TAIL, "epochs": 1, "batches_per_epoch": 6},
        {"name": "stopped", **TAIL, "steps": 20, "stop_at": 6},
    ]
    run_script([SCRIPT, "--out", str(out), "--runs", json.dumps(runs)], timeout=FIXTURE_BUDGET)
    return out


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_h1_plain_average_is_ddp(trained: Path) -> None:
    """inner_steps=1, outer_lr=1, no momentum, inner SGD: DiLoCo is DDP (up to rounding)."""
    ddp = weights(trained, "ddp_sgd")
    assert max_abs_diff(initial_weights(), ddp) > 1e-3, "DDP's run must move the weights"
    for rank in (0, 1):
        got = weights(trained, "h1_sgd", rank)
        print(f"h1 rank {rank} vs DDP: max abs diff {max_abs_diff(got, ddp):.3g}")
        assert_same_weights(got, ddp, atol=1e-6)
    assert info(trained, "h1_sgd")["syncs"] == 6


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_h4_adamw_matches_single_process_reference(trained: Path) -> None:
    """Each rank's AdamW steps on its own batches, averaged deltas, Nesterov outer SGD (lr 0.7, 0.9)."""
    start = initial_weights()
    for name, syncs, atol in (("h4_one_sync", 1, 1e-6), ("h4", 2, 5e-4)):
        batches = [torch.load(trained / f"{name}.rank{r}.batches.pt") for r in (0, 1)]
        assert len(batches[0]) == 4 * syncs and not torch.equal(batches[0][0][0], batches[1][0][0])
        expected = references.diloco(start, batches, 4, 0.7, 0.9, LR, WEIGHT_DECAY)
        assert info(trained, name)["syncs"] == syncs
        assert_same_weights(weights(trained, name, 1), weights(trained, name, 0), atol=0)
        got = weights(trained, name)
        moved = max_abs_diff(got, start)
        print(
            f"{name}: max abs diff to the reference {max_abs_diff(got, expected[0]):.3g} (moved {moved:.3g})"
        )
        assert_same_weights(got, expected[0], atol=atol)
        if syncs == 2:  # the test can tell the algorithm from its neighbours
            for label, lr, mu in (("no momentum", 0.7, 0.0), ("plain average", 1.0, 0.0)):
                other = references.diloco(start, batches, 4, lr, mu, LR, WEIGHT_DECAY)[0]
                assert max_abs_diff(got, other) > 20 * atol, label


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_resume_mid_period_is_bitwise_uninterrupted(trained: Path, tmp_path: Path) -> None:
    saved = torch.load(trained / "epoch1.ckpt", weights_only=False)["lightning_dist.diloco"]
    entry = torch.load(trained / "epoch1.ckpt.entry", weights_only=False)["lightning_dist.diloco"]
    for a, b in zip(saved["ranks"], entry["ranks"], strict=True):  # checkpoint_entry() without a dump
        assert_same_weights(a["state_dict"], b["state_dict"], atol=0)
        assert same_tree(a["optimizer_states"], b["optimizer_states"])
    assert saved["world_size"] == 2 and saved["inner_step"] == 2 and saved["syncs"] == 1
    r0, r1 = saved["ranks"]
    assert max_abs_diff(r0["state_dict"], r1["state_dict"]) > 0, "mid-period the ranks' weights differ"
    assert saved["outer"]["momentum"], "the outer momentum is saved"
    assert info(trained, "full")["global_step"] == info(trained, "resumed")["global_step"] == 12
    assert info(trained, "resumed")["syncs"] == info(trained, "full")["syncs"] == 3
    for rank in (0, 1):
        assert_same_weights(weights(trained, "resumed", rank), weights(trained, "full", rank), atol=0)
    # without DiLoCo's entry (a checkpoint of another strategy): a warning, every rank from rank 0's
    # weights and inner state, the outer state and the inner-step count afresh (a sync at step 10,
    # the tail's at 12); it trains on but does not continue exactly
    dropped = info(trained, "dropped")
    assert dropped["global_step"] == 12 and dropped["syncs"] == 2 and dropped["inner_step"] == 0
    drift = max_abs_diff(weights(trained, "dropped"), weights(trained, "full"))
    print(f"resumed without DiLoCo's state: max abs diff {drift:.3g} from the uninterrupted run")
    assert drift > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_resume_at_another_world_size_starts_from_the_last_sync(trained: Path) -> None:
    """A 2-rank checkpoint taken mid-period resumed by 1 rank: a warning, the model from the last-sync
    parameters (the steps since dropped), the outer momentum and sync count kept."""
    out = trained / "one_rank"
    run = {"name": "w1", "epochs": 2, "resume": str(trained / "epoch1.ckpt"), **RESUME}
    proc = run_script([SCRIPT, "--out", str(out), "--runs", json.dumps([run]), "--devices", "1"], timeout=120)
    assert "saved at world size 2, this run has 1" in proc.stderr + proc.stdout
    got = info(out, "w1")
    # 12 optimizer steps of 1 rank's 6 batches per epoch: resumed at 6 with inner step 0, one sync at
    # 10, the tail's at 12
    assert got["world_size"] == 1 and got["global_step"] == 12
    assert got["syncs"] == 3 and got["inner_step"] == 0 and got["sync_bytes"] == 0
    assert math.isfinite(got["train_loss"])


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_bytes_per_step_are_one_h_th_of_the_exchange(trained: Path) -> None:
    shapes = [tuple(p.shape) for p in TinyCausalLM(WorkloadConfig.tiny(seed=7)).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    expected = {
        "h4": ring_all_reduce_bytes(4 * numel, 2),
        "int8": Int8Quantization().wire_bytes(shapes, 2),  # at 2 ranks one all-gather, as modelled
    }
    for name, per_sync in expected.items():
        for rank in (0, 1):
            got = info(trained, name, rank)
            steps = got["global_step"]
            assert got["syncs"] == steps // 4 == 2
            assert got["sync_bytes"] / steps == per_sync / 4, name
            assert got["buffer_bytes"] == 0  # the workload has no persistent float buffers
            # no gradient all-reduce: besides the syncs only the logged loss (a scalar per step)
            other = got["comm"]["all_reduce.bytes_sent"] - (got["sync_bytes"] if name == "h4" else 0)
            assert other < expected["h4"] / 1000, (name, other)
    ratio = expected["int8"] / expected["h4"]
    print(f"bytes/step: none {expected['h4'] / 4:.0f}, int8 {expected['int8'] / 4:.0f} ({ratio:.3f} of none)")
    assert ratio < 0.3


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_accumulation_mixed_precision_and_metrics(trained: Path) -> None:
    for name, micro_batches in (("bf16_acc", 8), ("fp16", 4)):
        got = info(trained, name)
        assert got["global_step"] == 4 and got["micro_batches"] == micro_batches, name
        assert got["syncs"] == 2 and got["inner_step"] == 0, "a sync every 2 optimizer steps"
        assert_same_weights(weights(trained, name, 1), weights(trained, name, 0), atol=0)
        assert max_abs_diff(weights(trained, name), initial_weights()) > 1e-3, name
        assert math.isfinite(got["train_loss"])
    got, other = info(trained, "bf16_acc"), info(trained, "bf16_acc", 1)
    assert 0 < got["val_acc"] < 1 and got["val_loss"] == other["val_loss"], "sync_dist and torchmetrics sync"


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_float_buffers_are_averaged_at_each_sync(trained: Path) -> None:
    """Each rank adds its batches' mean token to a buffer; after the syncs every rank holds the
    ranks' average of those sums (one 4-byte all-reduce per sync)."""
    batches = [torch.load(trained / f"buffer.rank{r}.batches.pt") for r in (0, 1)]
    expected = sum(float(x.double().mean()) for shard in batches for x, _ in shard) / 2
    for rank in (0, 1):
        got = info(trained, "buffer", rank)
        assert got["syncs"] == 2 and got["buffer_bytes"] == 2 * ring_all_reduce_bytes(4, 2)
        value = float(weights(trained, "buffer", rank)["token_mean_sum"])
        assert value == pytest.approx(expected, rel=1e-6), (value, expected)
    local = [sum(float(x.double().mean()) for x, _ in shard) for shard in batches]
    assert abs(local[0] - local[1]) > 1.0, "the ranks' own sums differ, so averaging shows"


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
@pytest.mark.parametrize(
    ("name", "checkpoints"),
    [
        ("tail", ["last.ckpt"]),
        ("epoch_tail", ["epoch=0-step=6.ckpt", "last.ckpt"]),
        ("stopped", ["epoch=0-step=6.ckpt", "last.ckpt"]),
    ],
)
def test_a_fit_ending_inside_a_period_ends_every_rank_on_the_saved_weights(
    trained: Path, name: str, checkpoints: list[str]
) -> None:
    """6 optimizer steps with H=4, ended by max_steps, by max_epochs and by a should_stop: the 2
    steps after the sync at 4 are synced (a second sync), so both ranks end on the same weights,
    bitwise, and every checkpoint ModelCheckpoint wrote at the end holds them (Lightning's rank-0
    copy and each rank's DiLoCo entry)."""
    r0, r1 = weights(trained, name, 0), weights(trained, name, 1)
    assert_same_weights(r1, r0, atol=0)
    assert max_abs_diff(r0, initial_weights()) > 1e-3, "the comparison is of trained weights"
    for rank in (0, 1):
        got = info(trained, name, rank)
        assert (got["global_step"], got["syncs"], got["inner_step"]) == (6, 2, 0)
    saved = sorted(p.name for p in (trained / name).iterdir())
    assert saved == checkpoints
    for file in saved:
        checkpoint = torch.load(trained / name / file, weights_only=False)
        assert checkpoint["global_step"] == 6, file
        assert_same_weights(checkpoint["state_dict"], r0, atol=0)
        entry = checkpoint[CHECKPOINT_KEY]
        assert (entry["syncs"], entry["inner_step"]) == (2, 0), file
        for own in entry["ranks"]:
            assert_same_weights(own["state_dict"], r0, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(2 * FIXTURE_BUDGET)
def test_the_tail_is_the_outer_step_of_the_steps_since_the_last_sync(trained: Path) -> None:
    """From what each rank held before the tail sync (its weights after 2 inner steps; the last-sync
    weights and outer momentum, the same on both), by hand in float64: the averaged pseudo-gradient
    g = mean_r(anchor - w_r), the momentum m = 0.9 m + g and the Nesterov step anchor - 0.7 (g + 0.9 m),
    the outer step of a full period. Within 1e-6 (float32 rounding of weights about 1 in size)."""
    before = [torch.load(trained / f"tail.rank{r}.tail.pt") for r in (0, 1)]
    assert [b["inner_step"] for b in before] == [2, 2]
    outer = before[0]["outer"]
    assert same_tree(outer, before[1]["outer"]), "the ranks share the outer state"
    assert outer["momentum"].keys() == outer["anchors"].keys(), "the sync at 4 left a momentum"
    assert max_abs_diff(before[0]["params"], before[1]["params"]) > 1e-4, "the ranks' inner steps differ"
    expected, average = {}, {}
    for name, anchor in outer["anchors"].items():
        a = anchor.double()
        g = sum(a - b["params"][name].double() for b in before) / 2
        m = 0.9 * outer["momentum"][name].double() + g
        expected[name] = a - 0.7 * (g + 0.9 * m)
        average[name] = sum(b["params"][name].double() for b in before) / 2
    got = weights(trained, "tail")
    got = {name: got[name].double() for name in expected}
    drift = max(float((got[n] - expected[n]).abs().max()) for n in expected)
    print(f"tail vs the hand-computed outer step: max abs diff {drift:.3g}")
    assert drift <= 1e-6
    assert max_abs_diff(got, average) > 1e-3, "the tail is the outer step, not a plain average"
