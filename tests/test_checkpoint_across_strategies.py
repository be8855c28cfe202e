"""Checkpoints resumed by another strategy of the pack: a ``Sharded()`` checkpoint (a torch distributed
checkpoint directory) resumes under ``DDP()`` with its weights, optimizer state and loops; a
``Compressed("powersgd")`` checkpoint resumed by ``DDP()`` says that its compressor state is dropped,
as a resume that switches compressors does.

Fast: directories written as ``Sharded`` writes them, in this process (DCP without a process group).
Slow: 2 CPU processes in one launch (tests/scripts/cross_resume.py): ``Sharded()`` saves, ``DDP()``
resumes and ends where the uninterrupted ``Sharded()`` run ends; ``Compressed("powersgd")`` saves and
``DDP()`` resuming it warns."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import SCRIPTS, max_abs_diff, run_script
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_dist import DDP, Compressed
from lightning_dist.compat import _METADATA_FILENAME
from lightning_dist.strategies import compressed, sharded
from lightning_dist.strategies.foreign_checkpoints import (
    COMPRESSED_KEY,
    SHARDED_KEY,
    full_checkpoint,
    optimizer_state_by_index,
)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW after two steps (state in every parameter but the frozen one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model.extra = torch.nn.Linear(2, 2)  # type: ignore[assignment]
    model.extra.requires_grad_(False)
    optimizer = torch.optim.AdamW(
        [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.5}],
        lr=0.1,
    )
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def _rank_entry(state: dict[str, Any]) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def write_sharded_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank_state: dict[str, Any]
) -> dict[str, Any]:
    """``path`` as ``Sharded.save_checkpoint`` writes it at world size 2 (state dict, FQN-keyed optimizer
    state, each rank's own entry, Lightning's metadata file); the metadata written."""
    state = {
        "state_dict": model.state_dict(),
        "optimizer_0": get_optimizer_state_dict(model, optimizer),
        **{f"{SHARDED_KEY}.rank{r}": _rank_entry(rank_state) for r in (0, 1)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)
    meta = {
        "epoch": 1,
        "global_step": 6,
        "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"marker": 1}},
        "lr_schedulers": [],
        SHARDED_KEY: {"world_size": 2, "replicas": 1},
    }
    torch.save(meta, path / _METADATA_FILENAME)
    return meta


def test_the_keys_are_the_strategies_own() -> None:
    assert SHARDED_KEY == sharded.CHECKPOINT_KEY and COMPRESSED_KEY == compressed.CHECKPOINT_KEY


def test_a_sharded_checkpoint_loads_into_ddp_as_one_full_checkpoint(tmp_path: Path) -> None:
    model, optimizer = trained()
    meta = write_sharded_checkpoint(tmp_path / "ckpt", model, optimizer, {"replica_sync": {"keys": {}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Sharded() at one replica held no per-rank state: nothing to say
        checkpoint = DDP().load_checkpoint(tmp_path / "ckpt")
    for key in ("epoch", "global_step", "loops", "lr_schedulers", "pytorch-lightning_version"):
        assert checkpoint[key] == meta[key]
    assert max_abs_diff(checkpoint["state_dict"], model.state_dict()) == 0
    assert checkpoint["state_dict"].keys() == model.state_dict().keys()
    # the optimizer state as torch's own state_dict() has it (parameter indices), so DDP loads it
    expected = optimizer.state_dict()
    (got,) = checkpoint["optimizer_states"]
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, state in expected["state"].items():
        assert state.keys() == got["state"][index].keys()
        assert all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(got["state"][index][k])) for k, v in state.items()
        )
    fresh, fresh_optimizer = trained()
    fresh_optimizer.load_state_dict(got)  # torch accepts it: the same layout as the one it saves
    # one file for any strategy (Lightning's own refuse a folder): the same checkpoint
    torch.save(full_checkpoint(tmp_path / "ckpt"), tmp_path / "full.ckpt")
    written = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert max_abs_diff(written["state_dict"], model.state_dict()) == 0
    assert written["optimizer_states"][0]["param_groups"] == expected["param_groups"]
    assert written["global_step"] == meta["global_step"]


def test_per_rank_state_a_sharded_checkpoint_held_is_named_when_dropped(tmp_path: Path) -> None:
    model, optimizer = trained()
    held = {"replica_sync": {"keys": {}}, "residuals": {"0": torch.ones(3)}}
    write_sharded_checkpoint(tmp_path / "ckpt", model, optimizer, held)
    with pytest.warns(UserWarning, match=r"^DDP: the checkpoint is Sharded\(\)'s .*error-feedback residuals"):
        DDP().load_checkpoint(tmp_path / "ckpt")


def test_optimizer_state_by_index_keeps_torchs_order() -> None:
    model, optimizer = trained()
    by_name = get_optimizer_state_dict(model, optimizer)
    assert by_name["param_groups"][0]["params"] == ["0.weight", "0.bias"]
    assert optimizer_state_by_index(by_name)["param_groups"] == optimizer.state_dict()["param_groups"]


def test_a_directory_that_is_no_checkpoint_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"ckpt_path=.*empty.* is a directory but not a torch distributed"):
        DDP().load_checkpoint(tmp_path / "empty")
    plain = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=plain, no_dist=True)
    with pytest.raises(ValueError, match=r"has no meta.pt: not a Lightning checkpoint"):
        DDP().load_checkpoint(plain)


def compressed_checkpoint(path: Path, compressor: str, held: bool) -> Path:
    state = {"keys": {0: {"residual": {0: torch.ones(4)}}}} if held else {"keys": {}}
    ranks = [{"state": state, "layout": {0: [0, 1]}} for _ in range(2)]
    entry = {"world_size": 2, "compressor": compressor, "ranks": ranks}
    torch.save({"state_dict": {}, "global_step": 4, COMPRESSED_KEY: entry}, path)
    return path


def test_ddp_resuming_a_compressed_checkpoint_says_the_compressor_state_is_dropped(tmp_path: Path) -> None:
    ckpt = compressed_checkpoint(tmp_path / "powersgd.ckpt", "powersgd", held=True)
    with pytest.warns(UserWarning) as caught:
        DDP().load_checkpoint(ckpt)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("DDP: the checkpoint's compressor is 'powersgd', and DDP compresses nothing;")
    assert "Compressed('powersgd')" in message, "says how to keep it"


def test_no_word_when_nothing_is_dropped(tmp_path: Path) -> None:
    stateless = compressed_checkpoint(tmp_path / "fp16.ckpt", "fp16", held=False)
    held = compressed_checkpoint(tmp_path / "powersgd.ckpt", "powersgd", held=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DDP().load_checkpoint(stateless)  # fp16 keeps no state: a resume drops nothing
        Compressed("powersgd").load_checkpoint(held)  # Compressed loads it itself (load_compressor_state)


# -- 2 processes: Sharded() saves, DDP() resumes ---------------------------------------------------
BUDGET = 150
"""Seconds for the one launch below (five tiny fits, about 30 s on 2 quiet cores); the test's timeout is
twice that."""
ATOL = 1e-5
"""DDP() resumed from Sharded()'s checkpoint against Sharded() uninterrupted: the same steps, the
gradients reduced in another order (reduce-scatter against all-reduce)."""


@pytest.fixture(scope="module")
def cross_resumes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cross_resume")
    length = {"epochs": 1, "batches_per_epoch": 3}
    runs = [
        {"name": "sharded_full", "strategy": "sharded", **length, "epochs": 2},
        {"name": "sharded_half", "strategy": "sharded", **length, "save": str(out / "sharded_ckpt")},
        {"name": "ddp_from_sharded", "strategy": "ddp", **length, "epochs": 2, "resume": str(out / "sharded_ckpt")},
        # compressing from the first step (whatever the default warm-up), so the checkpoint holds residuals
        {"name": "powersgd_half", "strategy": "powersgd", "options": {"start_step": 0}, **length,
         "save": str(out / "powersgd.ckpt")},
        {"name": "ddp_from_powersgd", "strategy": "ddp", **length, "epochs": 2, "resume": str(out / "powersgd.ckpt")},
    ]  # fmt: skip
    run_script([str(SCRIPTS / "cross_resume.py"), "--out", str(out), "--runs", json.dumps(runs)], BUDGET)
    return out


def weights(out: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.rank{rank}.pt")


def info(out: Path, name: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_ddp_resumes_a_sharded_checkpoint_where_sharded_would_continue(cross_resumes: Path) -> None:
    out = cross_resumes
    assert (out / "sharded_ckpt").is_dir(), "Sharded() wrote a distributed checkpoint"
    resumed, full, half = (weights(out, n) for n in ("ddp_from_sharded", "sharded_full", "sharded_half"))
    assert info(out, "ddp_from_sharded")["global_step"] == info(out, "sharded_full")["global_step"] == 6
    assert max_abs_diff(weights(out, "ddp_from_sharded", 1), resumed) == 0, "the DDP ranks agree"
    moved = max_abs_diff(full, half)
    assert moved > 1e-3, f"the second epoch must move the weights (by {moved})"
    assert max_abs_diff(resumed, full) < ATOL, f"off the uninterrupted run by {max_abs_diff(resumed, full)}"
    assert info(out, "ddp_from_sharded")["warnings"] == [], "Sharded() at one replica held no per-rank state"


@pytest.mark.slow
@pytest.mark.timeout(2 * BUDGET)
def test_ddp_resuming_powersgd_warns_that_it_drops_the_compressor_state(cross_resumes: Path) -> None:
    out = cross_resumes
    (message,) = info(out, "ddp_from_powersgd")["warnings"]
    assert message.startswith("DDP: the checkpoint's compressor is 'powersgd', and DDP compresses nothing;")
    assert info(out, "ddp_from_powersgd")["global_step"] == 6
    assert info(out, "ddp_from_powersgd", 1)["warnings"] == [], "shown once, by rank 0"
