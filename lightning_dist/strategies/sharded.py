"""``Sharded``: FSDP2 (Lightning's ``ModelParallelStrategy``) with the pack's communication.

    L.Trainer(strategy=Sharded())                               # FSDP over all ranks
    L.Trainer(strategy=Sharded("int8"))                         # int8 reduce-scatter (ZeRO++ qgZ)
    L.Trainer(strategy=Sharded(replicas=2, replica_sync="int8"))  # HSDP, int8 across replicas
    L.Trainer(strategy="ld_sharded_bf16")

The Lightning adapter of the sharded layout part, ``strategy.layout`` (``ShardedLayout``: the
``(replicate, shard)`` mesh, which modules FSDP2 shards, the pack's collectives in FSDP2's extension
points, this rank's state in the distributed checkpoint). ``self.device_mesh`` in ``configure_model``
is that mesh; ``"data_parallel"`` is both dimensions flattened, as in ``ModelParallelStrategy``.
Every byte goes through communicators that share one ``CommStats`` (``strategy.communicator.stats``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_dist.collectives import Communicator, TorchBackend
from lightning_dist.compat import (
    _METADATA_FILENAME,
    _PATH,
    _materialize_distributed_module,
    _optimizers_to_device,
)
from lightning_dist.compression import Compressor
from lightning_dist.layout import torch_notes
from lightning_dist.layout.sharded_checkpoint import CHECKPOINT_KEY
from lightning_dist.layout.sharded_layout import ShardedLayout
from lightning_dist.strategies.batch_shares import BatchSharesMixin
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.launch_needs import LIGHTNING
from lightning_dist.strategies.names import register_class
from lightning_dist.strategies.options import (
    PROCESS_GROUP_BACKENDS,
    check_choice,
    option_names,
    options_from,
    reject_unknown_options,
)
from lightning_dist.strategies.options_training import ShardedOptions, SharesOptions
from lightning_dist.strategies.rank_state import TrainingStateMixin
from lightning_dist.warn import warn_once
from lightning_dist.wire.sharded_landing import PendingGradients

logger = logging.getLogger(__name__)


class Sharded(BatchSharesMixin, TrainingStateMixin, CollectiveOpsMixin, ModelParallelStrategy):
    """Sharded data parallelism (FSDP2, or HSDP with ``replicas > 1``) with the pack's communication.

    Args:
        compression: the reduce-scatter inside a shard group: None (fp32), ``"bf16"``, ``"fp16"``
            or ``"int8"`` (per-block absmax scales).
        int8_block_size: elements per int8 block (one fp32 scale each).
        error_feedback: int8: carry what quantisation dropped into the next step.
        replicas: replica groups (HSDP); 1 shards over every rank.
        replica_sync: how replica groups average their shard gradients: a compressor name
            (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"powersgd"`` ...) or a ``Compressor``.
        reduce_op: ``"avg"``, or ``"adasum"`` (gradient-space Adasum across replica groups, per
            parameter shard; with SGD it is Horovod's Adasum, with Adam a different algorithm).
        async_save: write distributed checkpoints in the background (``ShardedOptions.async_save``).
        shares: each rank's share of the global batch, as ``DDP``'s (docs/uneven-ranks.md).
        save_distributed_checkpoint, process_group_backend, timeout: as ``ModelParallelStrategy``.
    """

    strategy_name = "ld_sharded"
    launch_needs = LIGHTNING

    def __init__(
        self,
        compression: Optional[str] = None,
        *,
        int8_block_size: int = 1024,
        error_feedback: bool = False,
        replicas: int = 1,
        replica_sync: Union[str, Compressor] = "none",
        reduce_op: str = "avg",
        async_save: bool = False,
        shares: Any = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **unknown: Any,
    ) -> None:
        reject_unknown_options(type(self).__name__, unknown, self._accepted_options())
        check_choice("process_group_backend", process_group_backend, PROCESS_GROUP_BACKENDS)
        options = self.options = options_from(ShardedOptions, locals())
        self.layout = ShardedLayout(
            options.replicas,
            options.compression,
            options.int8_block_size,
            options.error_feedback,
            options.replica_sync,
            options.reduce_op,
            self.training_state,
        )
        """The sharded layout part: mesh, policy, FSDP2's collectives, per-rank checkpoint state."""
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._quiet: list[Any] = []
        self._init_shares(options_from(SharesOptions, locals()).shares)

    @classmethod
    def _accepted_options(cls) -> list[str]:
        """The keyword options this class accepts (named in the unknown-option error)."""
        return [
            *option_names(ShardedOptions),
            "shares",
            "save_distributed_checkpoint",
            "process_group_backend",
            "timeout",
        ]

    @property
    def is_distributed(self) -> bool:
        """Always: Lightning's connector knows ``ModelParallelStrategy`` as distributed already."""
        return True

    @property
    def replica_comm(self) -> Communicator:
        """The communicator over the ranks holding this rank's shard in every replica group."""
        return self.layout.replica_comm

    @property
    def fsdp_modules(self) -> list[FSDPModule]:
        """The FSDP modules holding parameters (each one FSDP parameter group), in ``modules()`` order."""
        return self.layout.fsdp_modules

    @property
    def pending_gradients(self) -> PendingGradients:
        """The reduce-scatters and replica syncs left in flight in the running backward (CPU)."""
        return self.layout.pending_gradients

    @override
    def setup_environment(self) -> None:
        from lightning_dist.preflight.slurm import check_ddp_under_slurm

        check_ddp_under_slurm(self)  # SLURM tasks vs devices/num_nodes, before the group forms
        self.layout.check(self.num_nodes * self.num_processes)
        self._setup_distributed()  # Lightning's: accelerator, ranks, process group
        self._quiet = torch_notes.quiet()  # until teardown
        if self.layout.mesh is None:  # once: a later fit or validate keeps the groups its modules use
            world_comm = Communicator(TorchBackend())
            meshes = self.layout.build(self.root_device.type, world_comm.stats, self.options.async_save)
            self._device_mesh = meshes.root
            self._set_communicator(world_comm)
            logger.debug("Sharded: rank %d, mesh %s", self.global_rank, meshes.root)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # configure_model's self.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank its own data: the flattened ``data_parallel`` mesh, as ``ModelParallelStrategy``
        (read from the mesh kept, not sliced from the root mesh)."""
        assert self.layout.mesh is not None, (
            "Sharded: the data-parallel mesh exists once setup_environment ran"
        )
        mesh = self.layout.mesh.data_parallel
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # every gradient in place before clipping and the optimizer (the end of the backward waited
        # for them already; this covers a backward that ran no final callbacks)
        self.layout.pending_gradients.wait_all()
        super().post_backward(closure_loss)

    @override
    def teardown(self) -> None:
        self.layout.close()
        torch_notes.restore(self._quiet)
        self._quiet = []
        super().teardown()

    @override
    def setup(self, trainer: Any) -> None:
        # ModelParallelStrategy.setup, with the default policy where configure_model sharded nothing
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._shard(self.model)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, model: torch.nn.Module) -> None:
        self.layout.shard(model)

    def replica_hook(self, module: FSDPModule, index: int) -> Optional[Callable[[Tensor], None]]:
        """The all-reduce hook FSDP2 calls with ``module``'s flat shard gradient (``ShardedLayout``)."""
        return self.layout.replica_hook(module, index)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            if self.training_state.held():
                warn_once(
                    "Sharded: save_distributed_checkpoint=False writes one full checkpoint without the "
                    f"per-rank state ({self._state_names()}); a resume from it starts that state afresh"
                )
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported; "
                "accepted: storage_options=None (the distributed checkpoint does not use CheckpointIO)"
            )
        # ModelParallelStrategy's distributed save, with this rank's own state as one more entry
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        rank_state = self.training_state.own(checkpoint)
        checkpoint[CHECKPOINT_KEY] = self.layout.describe()
        # in the background only inside fit: its teardown waits; a save after it is written at once
        self.layout.checkpoints.save(checkpoint, path, self.global_rank, rank_state, self._fitting())
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def _fitting(self) -> bool:
        """Whether a ``fit`` is running (its teardown comes after this save)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        running = (TrainerFn.FITTING, TrainerStatus.RUNNING)
        return trainer is not None and (trainer.state.fn, trainer.state.status) == running

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.layout.checkpoints.wait()
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            if self.options.error_feedback or self.options.replicas > 1:  # state this run will hold
                warn_once(
                    "Sharded: the checkpoint has no per-rank state (not written by Sharded); "
                    f"{self._state_names()} start afresh"
                )
            return checkpoint
        if saved != self.layout.describe():
            warn_once(
                f"Sharded: the checkpoint was written at world size {saved['world_size']} with "
                f"replicas={saved['replicas']}, this run has {self.world_size} and {self.options.replicas}: "
                "weights and optimizer state are resharded; the per-rank state "
                f"({self._state_names()}) is dropped and starts afresh"
            )
            return checkpoint
        path = Path(self.broadcast(checkpoint_path))
        saved_state = self.layout.checkpoints.load_rank_state(path, self.global_rank)
        self.training_state.load(saved_state)
        return checkpoint

    def _state_names(self) -> str:
        return ", ".join(self.training_state.words())

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_class(strategy_registry, cls)
