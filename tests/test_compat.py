"""The Trainer internals ``lightning_dist.compat`` reaches for Elastic, against the installed Lightning:
each function does what it says in a real (one-process, CPU) fit, the checkpoint paths it edits are
in what Lightning dumps, and nothing outside compat.py touches the Trainer's private attributes."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import lightning as L
import torch
from helpers import ROOT
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from lightning_dist import compat
from lightning_dist.workload.trainer import quiet_trainer


class _Started(L.Callback):
    """Records ``compat.fit_batches_started`` and the global step at every training batch's end."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append((trainer.global_step, compat.fit_batches_started(trainer)))


class _StatefulLoader(DataLoader):
    """A training DataLoader with a state, as Elastic's: what Lightning hands back on restore is kept."""

    loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"position": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)


class _Model(BoringModel):
    def train_dataloader(self) -> DataLoader:
        return _StatefulLoader(RandomDataset(32, 64), batch_size=2)


class _RestoringStrategy(SingleDeviceStrategy):
    """Hands the fit a loaded checkpoint in ``setup_environment``, as Elastic does with its commit."""

    def __init__(self, checkpoint: dict[str, Any]) -> None:
        super().__init__(device=torch.device("cpu"))
        self.checkpoint = checkpoint

    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.lightning_module is not None
        compat.restore_on_fit(self.lightning_module.trainer, self.checkpoint)


def _trainer(max_steps: int, **kwargs: Any) -> L.Trainer:
    return quiet_trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, **kwargs)


def test_fit_restores_the_checkpoint_handed_over_and_counts_batches(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first, seen = _trainer(3), _Started()
    first.callbacks.append(seen)  # type: ignore[attr-defined]
    first.fit(_Model())
    assert seen.seen == [(1, 1), (2, 2), (3, 3)]
    first.save_checkpoint(tmp_path / "three.ckpt")
    checkpoint = torch.load(tmp_path / "three.ckpt", weights_only=False)
    for path in compat.FIT_LOOP_CHECKPOINT_KEYS:
        node: Any = checkpoint
        for key in path:
            assert key in node, f"Lightning {L.__version__}'s checkpoint has no {'/'.join(path)}"
            node = node[key]
    assert compat.checkpoint_batch_progress(checkpoint)["current"]["ready"] == 3
    compat.set_checkpoint_loader_state(checkpoint, [{"position": 3}])

    resumed, seen = _trainer(5, strategy=_RestoringStrategy(checkpoint)), _Started()
    resumed.callbacks.append(seen)  # type: ignore[attr-defined]
    model = _Model()
    _StatefulLoader.loaded.clear()
    assert any(not torch.equal(v, checkpoint["state_dict"][k]) for k, v in model.state_dict().items())
    resumed.fit(model)
    assert _StatefulLoader.loaded == [{"position": 3}], "the loader state set in the checkpoint came back"
    assert seen.seen == [(4, 4), (5, 5)], "resumed after step 3, the epoch's earlier batches counted"
    assert seen.start.keys() == checkpoint["state_dict"].keys()
    for name, value in seen.start.items():
        assert torch.equal(value, checkpoint["state_dict"][name]), f"{name} starts from the checkpoint"


def test_disable_distributed_sampler_turns_the_trainer_flag_off() -> None:
    trainer = _trainer(1)
    compat.disable_distributed_sampler(trainer)
    assert trainer._accelerator_connector.use_distributed_sampler is False


def _private_trainer_names() -> set[str]:
    """The private attribute names compat reaches on the Trainer (``_checkpoint_connector`` ...)."""
    return {
        part
        for entry in compat.PRIVATE_ATTRIBUTES
        if entry.startswith("Trainer.")
        for part in entry.split(".")[1:]
        if part.startswith("_")
    }


def test_only_compat_reaches_into_the_trainer() -> None:
    names = _private_trainer_names()
    assert {"_accelerator_connector", "_checkpoint_connector", "_loaded_checkpoint"} <= names
    outside = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in (ROOT / "lightning_dist").rglob("*.py")
        if path.name != "compat.py"
        and (
            found := {
                node.attr
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in names | {"fit_loop"}
            }
        )
    }
    assert outside == {}, "go through a function of lightning_dist.compat"
