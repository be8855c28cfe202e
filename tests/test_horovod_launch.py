"""A Horovod strategy started without horovodrun/mpirun: ``Trainer(devices=2)`` is refused before any
training, naming the launch command (Horovod starts no processes itself: the fit would run at world
size 1); ``devices=1`` trains alone with one info line. Horovod's world is faked (no child process,
no Horovod needed)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import pytest
import torch

from lightning_dist import Horovod, HorovodAdasum
from lightning_dist.collectives.single import SingleProcessBackend
from lightning_dist.preflight.horovod_launch import LAUNCHER_VARS, check_horovod_launched
from lightning_dist.strategies.horovod_elastic import HorovodElastic
from lightning_dist.workload.trainer import quiet_trainer


class OneProcessHorovod(SingleProcessBackend):
    """Horovod as a process that no launcher started sees it: rank 0 of 1 (collectives are no-ops)."""

    local_rank = node_rank = 0
    local_size = 1

    def check_all_reduce(self, op: str, device_type: str) -> None:
        """HorovodAdasum's check of the MPI controller: met."""

    @contextlib.contextmanager
    def completions_held(self) -> Iterator[None]:
        yield


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.layer(batch[0]).sum()

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(8, 4))
        return torch.utils.data.DataLoader(data, batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


STRATEGIES: dict[str, tuple[Callable[[], Any], str]] = {
    "Horovod": (Horovod, "horovodrun -np 2 python "),
    "HorovodAdasum": (HorovodAdasum, "horovodrun --mpi -np 2 python "),
    "HorovodElastic": (HorovodElastic, "horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script"),
}
"""Each Horovod strategy and the launch command its error names."""


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_devices_2_without_a_launcher_is_refused_before_training(
    no_launcher: None, tmp_path: Any, name: str
) -> None:
    make, command = STRATEGIES[name]
    strategy = make()
    strategy._backend = OneProcessHorovod()
    model = Model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = quiet_trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, default_root_dir=tmp_path
    )
    with pytest.raises(ValueError) as info:
        trainer.fit(model)
    message = str(info.value)
    assert message.startswith(
        f"{name}: Trainer(devices=2) asks for 2 processes, but Horovod's world size is 1"
    )
    assert "not started by horovodrun or mpirun" in message
    assert command in message and "mpirun -np 2 python " in message
    assert "Trainer(devices=1)" in message
    assert model.steps == 0 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_num_nodes_counts_in_the_processes_asked_for(no_launcher: None) -> None:
    with pytest.raises(ValueError, match=r"Trainer\(devices=1, num_nodes=2\) asks for 2 processes"):
        check_horovod_launched("Horovod", world_size=1, devices=1, num_nodes=2, env={})


def test_one_device_without_a_launcher_trains_alone_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_dist"):
        check_horovod_launched("Horovod", world_size=1, devices=1, num_nodes=1, env={})
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == 1 and "world size 1" in lines[0] and "horovodrun -np N python " in lines[0]


@pytest.mark.parametrize(
    "var", ["OMPI_COMM_WORLD_SIZE", "HOROVOD_RANK", "PMI_RANK", "HOROVOD_GLOO_RENDEZVOUS_ADDR"]
)
def test_under_a_launcher_its_world_size_stands(caplog: pytest.LogCaptureFixture, var: str) -> None:
    """mpirun/horovodrun/srun --mpi decide the world (an elastic job may shrink to 1): no error, no line."""
    with caplog.at_level(logging.INFO, logger="lightning_dist"):
        check_horovod_launched("Horovod", world_size=1, devices=2, num_nodes=1, env={var: "0"})
        check_horovod_launched("Horovod", world_size=2, devices=1, num_nodes=1, env={var: "0"})
    assert not caplog.records
