"""``Sharded``: FSDP2 (Lightning's ``ModelParallelStrategy``) with the pack's communication.

    L.Trainer(strategy=Sharded())                               # FSDP over all ranks
    L.Trainer(strategy=Sharded("int8"))                         # int8 reduce-scatter (ZeRO++ qgZ)
    L.Trainer(strategy=Sharded(replicas=2, replica_sync="int8"))  # HSDP, int8 across replicas
    L.Trainer(strategy="ld_sharded_bf16")

Sharding is FSDP2's: the strategy builds a 2-D ``(replicate, shard)`` device mesh (``self.device_mesh``
in ``configure_model``; ``"data_parallel"`` is both dimensions flattened, as in
``ModelParallelStrategy``; ``sharded_mesh``), and every module is ``fully_shard``-ed over this rank's
shard group only (``device_mesh["shard"]``, or with one replica group any mesh of the same ranks), by
the user's ``configure_model`` or, where it shards nothing, by the default per-layer policy
(``sharding_policy``). The pack fills FSDP2's two gradient extension points (``sharded_comm``): the
reduce-scatter inside a shard group (fp32, bf16, fp16 or int8 with per-block scales) and, with
``replicas > 1``, the replica groups' sync of each shard gradient (any compressor of the pack, or
gradient-space Adasum), the way torchft drives HSDP. Every byte goes through communicators over the
shard, replicate and world groups that share one ``CommStats`` (``strategy.communicator.stats``).

Subclasses (DiLoCo over shards) hook in through ``install_hooks`` / ``replica_hook`` (per FSDP
parameter group) and ``sharded_rank_state`` / ``load_sharded_rank_state`` (per-rank state in the
distributed checkpoint).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from torch.distributed.checkpoint import async_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.collectives import Communicator, TorchBackend
from lightning_dist.compat import (
    _METADATA_FILENAME,
    _PATH,
    _distributed_checkpoint_load,
    _distributed_checkpoint_save,
    _materialize_distributed_module,
    _optimizers_to_device,
)
from lightning_dist.compression import COMPRESSORS, Compressor, make_compressor
from lightning_dist.layout import torch_notes
from lightning_dist.layout.sharded_mesh import MESH_DIMS, ShardedMesh, mesh_refusal
from lightning_dist.layout.sharding_policy import (
    fsdp_modules,
    shard_by_layer,
    split_ties,
    unsharded_parameters,
)
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.launch_needs import LIGHTNING
from lightning_dist.strategies.names import register_class
from lightning_dist.strategies.options import (
    PROCESS_GROUP_BACKENDS,
    ShardedOptions,
    check_choice,
    option_names,
    options_from,
    reject_unknown_options,
)
from lightning_dist.warn import warn_once
from lightning_dist.wire.sharded_comm import PackAllGather, PackReduceScatter, ReplicaSync
from lightning_dist.wire.sharded_landing import Landing, PendingGradients

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_dist.sharded"
"""In the checkpoint's metadata: ``{"world_size": W, "replicas": R}``; in the distributed checkpoint,
``CHECKPOINT_KEY.rank<r>`` holds rank r's ``sharded_rank_state()``."""


class Sharded(CollectiveOpsMixin, ModelParallelStrategy):
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
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **unknown: Any,
    ) -> None:
        reject_unknown_options(type(self).__name__, unknown, self._accepted_options())
        check_choice("process_group_backend", process_group_backend, PROCESS_GROUP_BACKENDS)
        self.options = options_from(ShardedOptions, locals())
        self.replica_compressor = self._build_replica_compressor(self.options)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._shard_comm: Optional[Communicator] = None
        self._replica_comm: Optional[Communicator] = None
        self.reduce_scatters: list[PackReduceScatter] = []
        """One per FSDP parameter group, in ``fsdp_modules`` order (they hold the int8 residuals)."""
        self.fsdp_modules: list[FSDPModule] = []
        """The FSDP modules holding parameters (each one FSDP parameter group), in ``modules()`` order."""
        self._checkpoint_group: Optional[Any] = None
        self._pending_save: Optional[Any] = None
        self._data_parallel_mesh: Optional[DeviceMesh] = None
        self._quiet: list[Any] = []
        self.pending_gradients = PendingGradients()
        """The reduce-scatters and replica syncs left in flight in the running backward (CPU)."""

    @classmethod
    def _accepted_options(cls) -> list[str]:
        """The keyword options this class accepts (named in the unknown-option error)."""
        return [
            *option_names(ShardedOptions),
            "save_distributed_checkpoint",
            "process_group_backend",
            "timeout",
        ]

    @staticmethod
    def _build_replica_compressor(options: ShardedOptions) -> Compressor:
        sync = options.replica_sync
        if not isinstance(sync, Compressor) and str(sync).lower() not in COMPRESSORS:
            raise ValueError(
                f"replica_sync={sync!r} is not supported; accepted: {', '.join(map(repr, COMPRESSORS))} "
                "or a lightning_dist.compression.Compressor"
            )
        compressor = sync if isinstance(sync, Compressor) else make_compressor(sync)
        if options.reduce_op == "adasum" and not compressor.supports_adasum:
            raise ValueError(
                f"reduce_op='adasum' is not supported with replica_sync={compressor.name!r}; accepted: "
                "replica_sync='none', 'fp16' or 'bf16'"
            )
        return compressor

    @property
    def is_distributed(self) -> bool:
        """Always: Lightning's connector knows ``ModelParallelStrategy`` as distributed already."""
        return True

    # -- process groups, mesh and communicators ---------------------------------------------------
    @property
    def shard_comm(self) -> Communicator:
        """The communicator over this rank's shard group (FSDP's reduce-scatter goes through it)."""
        assert self._shard_comm is not None, (
            "Sharded: the shard communicator exists once setup_environment ran"
        )
        return self._shard_comm

    @property
    def replica_comm(self) -> Communicator:
        """The communicator over the ranks holding this rank's shard in every replica group."""
        assert self._replica_comm is not None, (
            "Sharded: the replica communicator exists once setup_environment ran"
        )
        return self._replica_comm

    @property
    def shards(self) -> int:
        """Ranks per replica group (the shard group's size)."""
        return self.world_size // self.options.replicas

    @override
    def setup_environment(self) -> None:
        from lightning_dist.preflight.slurm import check_ddp_under_slurm

        check_ddp_under_slurm(self)  # SLURM tasks vs devices/num_nodes, before the group forms
        world = self.num_nodes * self.num_processes
        replicas = self.options.replicas
        if world % replicas:
            raise ValueError(
                f"replicas={replicas} must divide the world size {world} (devices x num_nodes); accepted: "
                f"{', '.join(str(r) for r in range(1, world + 1) if world % r == 0)}"
            )
        self._setup_distributed()  # Lightning's: accelerator, ranks, process group
        self._quiet = torch_notes.quiet()  # until teardown
        if self._device_mesh is None:  # once: a later fit or validate keeps the groups its modules use
            meshes = ShardedMesh.build(self.root_device.type, self.options.replicas, self.shards)
            mesh = self._device_mesh = meshes.root
            self._data_parallel_mesh = meshes.data_parallel
            world_comm = Communicator(TorchBackend())
            self._set_communicator(world_comm)
            stats = world_comm.stats  # one set of counters for every group
            self._shard_comm = Communicator(TorchBackend(mesh.get_group("shard")), stats)
            self._replica_comm = Communicator(TorchBackend(mesh.get_group("replicate")), stats)
            if self.options.async_save:  # DCP's background writer coordinates over a group of its own
                self._checkpoint_group = mesh[MESH_DIMS]._flatten("checkpoint", "gloo").get_group()
            logger.debug("Sharded: rank %d, mesh %s", self.global_rank, mesh)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # configure_model's self.device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank its own data: the flattened ``data_parallel`` mesh, as ``ModelParallelStrategy``
        (read from the mesh kept, not sliced from the root mesh)."""
        mesh = self._data_parallel_mesh
        assert mesh is not None, "Sharded: the data-parallel mesh exists once setup_environment ran"
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # every gradient in place before clipping and the optimizer (the end of the backward waited
        # for them already; this covers a backward that ran no final callbacks)
        self.pending_gradients.wait_all()
        super().post_backward(closure_loss)

    @override
    def teardown(self) -> None:
        self.pending_gradients.clear()  # a failed step's collectives: a peer may be gone
        self.wait_for_checkpoint()
        for comm in (self._shard_comm, self._replica_comm):
            if comm is not None:
                comm.close()
        torch_notes.restore(self._quiet)
        self._quiet = []
        super().teardown()

    # -- sharding and hooks ---------------------------------------------------------------------
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
        modules = fsdp_modules(model)
        if not modules:
            modules = shard_by_layer(model, self.device_mesh["shard"])
        left = unsharded_parameters(model)
        if left:
            raise ValueError(
                f"Sharded: parameters outside every fully_shard-ed module would not be synchronised: "
                f"{', '.join(left[:8])}{' ...' if len(left) > 8 else ''}; fully_shard the modules holding "
                "them (mesh=self.device_mesh['shard']) in configure_model, or leave configure_model "
                "without fully_shard calls for the default per-layer policy"
            )
        split = split_ties(model)
        if split:
            raise ValueError(
                "Sharded: modules sharing a parameter are sharded into different FSDP units, which would "
                f"train them apart: {'; '.join(' and '.join(names) for names in split)}; fully_shard them "
                "together (fully_shard([module_a, module_b], mesh=self.device_mesh['shard'])) or shard a "
                "module holding all of them, or leave configure_model without fully_shard calls: the "
                "default policy does"
            )
        # units without parameters of their own (a stack whose blocks are units) communicate nothing
        modules = [m for m in modules if m._get_fsdp_state()._fsdp_param_groups]
        # a second setup of the same modules (validate after fit, fit again) keeps their residuals
        residuals = {
            id(m): rs.residual for m, rs in zip(self.fsdp_modules, self.reduce_scatters, strict=True)
        }
        self.fsdp_modules = modules
        self.reduce_scatters = []
        for index, module in enumerate(modules):
            self._check_mesh(module)
            self.install_hooks(module, index)
        for module, reduce_scatter in zip(modules, self.reduce_scatters, strict=True):
            reduce_scatter.residual = residuals.get(id(module))
        logger.debug("Sharded: %d FSDP modules, hooks installed", len(modules))

    def _check_mesh(self, module: FSDPModule) -> None:
        """Refuse, before training, a module FSDP2 would not shard over this rank's shard group alone."""
        for group in module._get_fsdp_state()._fsdp_param_groups:
            refusal = mesh_refusal(
                group.mesh_info.mesh, self.device_mesh["shard"], self.options.replicas, type(module).__name__
            )
            if refusal is not None:
                raise ValueError(refusal)

    def install_hooks(self, module: FSDPModule, index: int) -> None:
        """Fill FSDP2's extension points of ``module`` (the ``index``-th FSDP module): the pack's
        all-gather and reduce-scatter over the shard group, and ``replica_hook``'s all-reduce hook, if any. A
        subclass may override this, or only ``replica_hook``."""
        options = self.options
        reduce_scatter = PackReduceScatter(
            self.shard_comm,
            options.compression,
            options.int8_block_size,
            options.error_feedback,
            landing=Landing.of(module, self.pending_gradients),
        )
        module.set_custom_all_gather(PackAllGather(self.shard_comm))
        module.set_custom_reduce_scatter(reduce_scatter)
        self.reduce_scatters.append(reduce_scatter)
        hook = self.replica_hook(module, index)
        if hook is not None:
            module.set_all_reduce_hook(hook)

    def replica_hook(self, module: FSDPModule, index: int) -> Optional[Callable[[Tensor], None]]:
        """The hook FSDP2 calls with ``module``'s reduce-scattered shard gradient (flat, in place):
        the replica groups' sync (``ReplicaSync``), or None with one replica group. A subclass that
        syncs replicas otherwise (DiLoCo over shards) returns None."""
        if self.options.replicas == 1:
            return None
        return ReplicaSync(
            self.replica_comm,
            self.replica_compressor,
            key=f"fsdp{index}",
            shards=shard_layout(module),
            adasum=self.options.reduce_op == "adasum",
            reduce_scatter=self.reduce_scatters[index],
            pending=self.pending_gradients,
        )

    # -- per-rank state in the distributed checkpoint ----------------------------------------------
    def sharded_rank_state(self) -> dict[str, Any]:
        """This rank's own state (CPU tensors and plain values), saved in the distributed checkpoint
        under this rank and loaded back by the same rank at the same layout. A subclass adds its
        entries: ``{**super().sharded_rank_state(), "mine": ...}``."""
        state: dict[str, Any] = {"replica_sync": to_cpu(self.replica_compressor.state_dict())}
        residuals = {
            str(i): rs.residual for i, rs in enumerate(self.reduce_scatters) if rs.residual is not None
        }
        if residuals:
            state["residuals"] = to_cpu(residuals)
        return state

    def load_sharded_rank_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``sharded_rank_state`` returned on this rank (a subclass takes its entries
        and calls ``super()``)."""
        self.replica_compressor.load_state_dict(state["replica_sync"])
        for key, residual in state.get("residuals", {}).items():
            self.reduce_scatters[int(key)].residual = residual.to(self.root_device)

    def _layout(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "replicas": self.options.replicas}

    def _rank_key(self, rank: int) -> str:
        return f"{CHECKPOINT_KEY}.rank{rank}"

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            if self.holds_rank_state():
                warn_once(
                    "Sharded: save_distributed_checkpoint=False writes one full checkpoint without the "
                    f"per-rank state ({', '.join(self.rank_state_names())}); a resume from it starts that "
                    "state afresh"
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
        converted: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            converted[f"optimizer_{idx}"] = optim_state
        converted[self._rank_key(self.global_rank)] = _as_bytes(self.sharded_rank_state())
        checkpoint[CHECKPOINT_KEY] = self._layout()
        self.wait_for_checkpoint()
        if self._checkpoint_group is not None and self._fitting():
            # teardown waits for it; a save outside fit (after it) is written at once
            self._pending_save = async_save(
                converted, checkpoint_id=path, process_group=self._checkpoint_group
            )
        else:
            _distributed_checkpoint_save(converted, path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def _fitting(self) -> bool:
        """Whether a ``fit`` is running (its teardown comes after this save)."""
        module = self.lightning_module
        trainer = None if module is None else module._trainer
        return (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )

    def wait_for_checkpoint(self) -> None:
        """Until the checkpoint being written in the background (``async_save``), if any, is complete."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.result()

    def holds_rank_state(self) -> bool:
        """Whether this rank holds per-rank state a full checkpoint would lose (a subclass adds its own)."""
        return bool(self.replica_compressor.state_dict()["keys"]) or any(
            rs.residual is not None for rs in self.reduce_scatters
        )

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            if self.options.error_feedback or self.options.replicas > 1:  # state this run will hold
                warn_once(
                    "Sharded: the checkpoint has no per-rank state (not written by Sharded); "
                    f"{', '.join(self.rank_state_names())} start afresh"
                )
            return checkpoint
        if saved != self._layout():
            warn_once(
                f"Sharded: the checkpoint was written at world size {saved['world_size']} with "
                f"replicas={saved['replicas']}, this run has {self.world_size} and {self.options.replicas}: "
                "weights and optimizer state are resharded; the per-rank state "
                f"({', '.join(self.rank_state_names())}) is dropped and starts afresh"
            )
            return checkpoint
        key = self._rank_key(self.global_rank)
        loaded: dict[str, Any] = {key: io.BytesIO()}  # DCP fills it with the saved bytes
        _distributed_checkpoint_load(loaded, Path(self.broadcast(checkpoint_path)))
        self.load_sharded_rank_state(_from_bytes(loaded[key]))
        return checkpoint

    def rank_state_names(self) -> list[str]:
        """What ``sharded_rank_state`` holds, in words, for the warning of a resume that drops it
        (a subclass adds its own: ``[*super().rank_state_names(), "DiLoCo's outer momentum"]``)."""
        return ["error-feedback residuals", "replica-sync compressor state"]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_class(strategy_registry, cls)


def _as_bytes(state: Any) -> io.BytesIO:
    """``state`` as one opaque entry of a distributed checkpoint (written by its own rank only,
    whatever its structure; DCP loads it back as the object)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def _from_bytes(value: Any) -> Any:
    """The state ``_as_bytes`` wrote (DCP hands it back as a ``BytesIO``)."""
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=True)
    return value


def shard_layout(module: FSDPModule) -> list[tuple[int, torch.Size]]:
    """(offset, local shard shape) of each parameter in the flat shard gradient FSDP2 hands to the
    all-reduce hook of ``module``'s parameter group (each parameter's shard padded to equal size)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:  # every parameter is in a sharded child (nn.TransformerEncoder): no hook call
        return []
    (group,) = groups
    layout, offset = [], 0
    for param in group.fsdp_params:
        layout.append((offset, torch.Size(param.sharded_size)))
        offset += param.padded_sharded_param_size.numel()
    return layout
