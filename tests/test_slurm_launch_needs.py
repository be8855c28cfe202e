"""`lightning-dist slurm` asks each strategy class for its ``launch_needs`` and writes the script from
them: a class of the user's own that declares them is launched like the pack's class with the same
needs, and the launch modules name no strategy class (fast, in-process)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dist.strategies as strategies
from lightning_dist.launch import slurm
from lightning_dist.launch.slurm import SlurmJob, resolve_strategy
from lightning_dist.strategies.launch_needs import ENGINES, TORCHFT_ONE_PROCESS, TORCHRUN, LaunchNeeds

CMD = ["python", "examples/train.py"]
"""The package's trainer: the strategy's name is the only difference its scripts may show."""


def _register(monkeypatch: pytest.MonkeyPatch, name: str, cls: type) -> None:
    monkeypatch.setitem(StrategyRegistry, name, {"strategy": cls, "init_params": {}, "description": name})


@pytest.mark.parametrize(
    ("needs", "reference", "devices"),
    [(TORCHRUN, "ld_elastic", 2), (TORCHFT_ONE_PROCESS, "ld_fault_tolerant_diloco", 1)],
)
def test_a_strategy_of_ones_own_is_launched_by_the_needs_it_declares(
    monkeypatch: pytest.MonkeyPatch, needs: LaunchNeeds, reference: str, devices: int
) -> None:
    """A ``DDP`` subclass outside the pack that declares another engine's needs gets the script of the
    pack's strategy with those needs, its name aside (it was "not a strategy lightning-dist can launch")."""

    class MyStrategy(strategies.DDP):
        launch_needs = needs

    _register(monkeypatch, "my_strategy", MyStrategy)
    for requeue in (True, False):
        ours, theirs = (
            SlurmJob(CMD, nodes=2, devices=devices, strategy=s, requeue=requeue).render()
            for s in ("my_strategy", reference)
        )
        assert ours == theirs.replace(reference, "my_strategy")
    assert resolve_strategy("my_strategy") == needs


def test_a_subclass_inherits_its_parents_needs_and_a_refusal_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subclass launches as its parent does; one whose needs are refused is refused with the reason."""

    class MyHorovod(strategies.Horovod):
        pass

    class MyRefused(strategies.DDP):
        launch_needs = LaunchNeeds("torchrun", refused="it needs a launcher of its own")

    _register(monkeypatch, "my_horovod", MyHorovod)
    _register(monkeypatch, "my_refused", MyRefused)
    ours = SlurmJob(CMD, nodes=2, devices=2, strategy="my_horovod", mpi="mpirun").render()
    assert ours == SlurmJob(CMD, nodes=2, devices=2, strategy="ld_horovod", mpi="mpirun").render().replace(
        "ld_horovod", "my_horovod"
    )
    with pytest.raises(
        ValueError, match=r"'my_refused' is refused under SLURM: it needs a launcher of its own"
    ):
        SlurmJob(CMD, strategy="my_refused")


def test_every_strategy_class_declares_launch_needs() -> None:
    for name in strategies.STRATEGIES:
        assert isinstance(getattr(strategies, name).launch_needs, LaunchNeeds), name
    with pytest.raises(
        ValueError, match=r"LaunchNeeds\(engine='slurm'\); accepted: lightning, mpi, torchrun, torchft"
    ):
        LaunchNeeds("slurm")
    assert ENGINES == ("lightning", "mpi", "torchrun", "torchft")


def test_the_launch_modules_name_no_strategy_class() -> None:
    """The script follows from ``launch_needs`` alone: no module of ``lightning-dist slurm`` imports or
    names one of the pack's strategy classes (a new strategy needs no change there)."""
    classes = set(strategies.__all__)
    allowed = {"lightning_dist.strategies.launch_needs", "lightning_dist.strategies.registry"}
    paths = sorted(Path(slurm.__file__).parent.glob("slurm*.py"))
    for path in paths:
        tree = ast.parse(path.read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not named & classes, (path.name, sorted(named & classes))
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert {m for m in modules if m.startswith("lightning_dist.strategies.")} <= allowed, path.name
    assert len(paths) > 1, "the split modules (slurm_strategy.py, slurm_script.py, ...) were not found"
