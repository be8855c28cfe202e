"""``HorovodBase``: what ``Horovod`` and ``HorovodAdasum`` share, as Lightning 2.x strategies on Horovod.

Processes come from horovodrun, mpirun or srun (one rank each); ranks, world size and devices are
Horovod's. At setup the model and the optimizers' state are broadcast from rank 0 and the learning
rates scaled once. What crosses the wire at each step is the subclasses' choice: ``Horovod``
(``horovod.py``) all-reduces the gradients, ``HorovodAdasum`` (``horovod_adasum.py``) combines the
optimizer updates with Adasum.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_dist.algorithms.lr_scaling import scale_learning_rates
from lightning_dist.collectives import Communicator
from lightning_dist.collectives.horovod_backend import HorovodBackend
from lightning_dist.collectives.model_check import check_same_model
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.launch_needs import MPI
from lightning_dist.strategies.metric_sync import route_metric_sync
from lightning_dist.strategies.names import register_class
from lightning_dist.strategies.options import option_names
from lightning_dist.strategies.options_training import HorovodOptions

logger = logging.getLogger(__name__)

HOROVOD_OPTIONS = tuple(option_names(HorovodOptions))
"""The keyword arguments ``Horovod`` and ``HorovodAdasum`` accept (named in the unknown-option error)."""


def _from_backend(name: str) -> Any:
    """A read-only property overriding Lightning's rank property with the ``HorovodBackend``'s ``name``."""

    def value(self: HorovodBase) -> int:
        return getattr(self.backend, name)  # type: ignore[no-any-return]

    return property(value, doc=f"Horovod's {name}.")


class HorovodBase(CollectiveOpsMixin, ParallelStrategy):
    """The Horovod strategies' common part (not registered, not meant to be built directly).

    Args:
        lr_scale: ``"auto"`` (the subclass's rule, ``_auto_lr_scale``) or a number > 0 (1.0 turns
            scaling off). The factor multiplies every optimizer param group's ``lr`` once, at setup.

    ``isinstance(strategy, HorovodBase)`` means "any Horovod strategy of the pack".
    """

    op: str
    """The reduction this strategy applies: ``"average"``, ``"sum"`` or ``"adasum"``."""
    launch_needs = MPI

    def __init__(
        self,
        lr_scale: Union[str, float] = "auto",
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        HorovodOptions(lr_scale=lr_scale)  # checks it
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self.lr_scale = lr_scale
        self.num_nodes = 1
        """The Trainer's ``num_nodes`` (Lightning sets it): Horovod's launcher decides the nodes; it is
        read only to tell a job that asked for several processes but was not launched."""
        self._backend: Optional[HorovodBackend] = None
        self.applied_lr_scale = 1.0

    # -- ranks and devices -----------------------------------------------------------------------
    @property
    def backend(self) -> HorovodBackend:
        if self._backend is None:
            self._backend = HorovodBackend()
        return self._backend

    # Lightning's rank properties, read from Horovod (``HorovodBackend``)
    global_rank = _from_backend("rank")
    local_rank = _from_backend("local_rank")
    node_rank = _from_backend("node_rank")
    world_size = _from_backend("world_size")

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector for strategies outside Lightning (sampler, sync_dist)."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        device = devices[self.local_rank] if self.local_rank < len(devices) else devices[0]
        if device.type == "cuda":
            return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
        return device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun / mpirun / srun start the processes

    @override
    def setup_environment(self) -> None:
        from lightning_dist.preflight.horovod_launch import check_strategy_launched
        from lightning_dist.preflight.slurm import check_horovod_under_slurm

        check_horovod_under_slurm(self)  # under SLURM: one MPI job of SLURM_NTASKS ranks
        check_strategy_launched(self)  # devices=2 without horovodrun/mpirun would train alone
        self._set_communicator(Communicator(self.backend))
        logger.debug(
            "%s: rank %d of %d on %s",
            type(self).__name__,
            self.global_rank,
            self.world_size,
            self.root_device,
        )
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- setup: checks, broadcast, lr scaling, then the subclass's step sync ---------------------
    @override
    def setup(self, trainer: L.Trainer) -> None:
        self._check_configuration(trainer)
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        assert self.model is not None
        check_same_model(self.model, type(self).__name__, self._transport())
        self._broadcast_module_state()
        metrics = route_metric_sync(self.model, self._transport())
        logger.debug("%s: model broadcast from rank 0; %d torchmetrics routed", type(self).__name__, metrics)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
            self._scale_learning_rates()
            self._broadcast_optimizer_state()
            logger.debug(
                "%s: optimizers broadcast; lr scaled by %s", type(self).__name__, self.applied_lr_scale
            )
            self._setup_step_sync()
        self.setup_precision_plugin()

    def _check_configuration(self, trainer: L.Trainer) -> None:
        """Refuse, on every rank, what this job cannot run (before any collective)."""

    def _setup_step_sync(self) -> None:
        """Prepare what synchronises the ranks at each step (fit only; the optimizers are set up)."""

    def _backend_communicator(self) -> Communicator:
        """The communicator, made from Horovod's backend when none is yet (a checkpoint written by a
        strategy that was not set up in this process): Horovod's ranks exist once it is initialised."""
        if self._communicator is None:
            self._set_communicator(Communicator(self.backend))
        return self._transport()

    def _broadcast_module_state(self) -> None:
        assert self.model is not None
        comm = self._transport()
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                comm.broadcast(tensor.data, 0)

    def _broadcast_optimizer_state(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            state = self._transport().broadcast_object(optimizer.state_dict(), 0)
            if self.global_rank != 0:
                self.optimizers[i].load_state_dict(state)

    def lr_scale_factor(self) -> float:
        """The factor ``lr_scale`` resolves to for this job (see the class docstring)."""
        if self.lr_scale != "auto":
            return float(self.lr_scale)
        return self._auto_lr_scale()

    def _auto_lr_scale(self) -> float:
        """The factor of ``lr_scale="auto"`` (Horovod's guidance for this strategy's reduction)."""
        return 1.0

    def _scale_learning_rates(self) -> None:
        self.applied_lr_scale = self.lr_scale_factor()
        scale_learning_rates(self.optimizers, self.lr_scheduler_configs, self.applied_lr_scale)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_class(strategy_registry, cls)  # the names in strategies/names.py that build this class
