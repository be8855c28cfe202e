"""The sharded (FSDP2) and hybrid (replicas x shards) *layout* part, without Lightning.

One object a strategy holds: the ``(replicate, shard)`` mesh and the communicators over its groups
(``sharded_mesh``), which modules FSDP2 shards (``sharding_policy``, with the checks that refuse a
layout that would train apart), the pack's collectives in FSDP2's extension points of every FSDP
module (``wire.sharded_comm``: the reduce-scatter inside a shard group and, with ``replicas > 1``,
the replica groups' sync of each shard gradient, the way torchft drives HSDP), and this rank's own
state in the distributed checkpoint (``sharded_checkpoint``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.collectives import CommStats, Communicator, TorchBackend
from lightning_dist.compression import COMPRESSORS, Compressor
from lightning_dist.compression.builder import build_compressor
from lightning_dist.layout.sharded_checkpoint import ShardedCheckpoints
from lightning_dist.layout.sharded_mesh import MESH_DIMS, ShardedMesh, mesh_refusal
from lightning_dist.layout.sharding_policy import (
    fsdp_modules,
    shard_by_layer,
    split_ties,
    unsharded_parameters,
)
from lightning_dist.state import StateRegistry
from lightning_dist.wire.sharded_comm import PackAllGather, PackReduceScatter, ReplicaSync
from lightning_dist.wire.sharded_landing import Landing, PendingGradients

logger = logging.getLogger(__name__)


class ShardedLayout:
    """FSDP2 over each shard group of ``replicas`` replica groups, with the pack's collectives.

    Args:
        replicas: replica groups (HSDP); 1 shards over every rank.
        compression, int8_block_size, error_feedback: the reduce-scatter inside a shard group
            (``PackReduceScatter``).
        replica_sync, reduce_op: the replica groups' compressor, and ``"adasum"`` for their
            gradient-space Adasum (else the mean).
    """

    def __init__(
        self,
        replicas: int,
        compression: Optional[str],
        int8_block_size: int,
        error_feedback: bool,
        replica_sync: Union[str, Compressor],
        reduce_op: str,
        state: StateRegistry,
    ) -> None:
        sync = build_compressor(replica_sync, COMPRESSORS, argument="replica_sync")
        if reduce_op == "adasum" and not sync.supports_adasum:
            raise ValueError(
                f"reduce_op='adasum' is not supported with replica_sync={sync.name!r}; accepted: "
                "replica_sync='none', 'fp16' or 'bf16'"
            )
        self.replicas, self.replica_sync, self.adasum = replicas, sync, reduce_op == "adasum"
        self.reduce_scatter_options = (compression, int8_block_size, error_feedback)
        """``PackReduceScatter``'s compression, int8 block size and error feedback."""
        self.replica_gradients = True
        """Sync each shard gradient across replica groups every step (False where another part
        syncs the replica groups: DiLoCo over shards)."""
        self.mesh: Optional[ShardedMesh] = None
        self.world_size = 0
        self._shard_comm: Optional[Communicator] = None
        self._replica_comm: Optional[Communicator] = None
        self.reduce_scatters: list[PackReduceScatter] = []
        """One per FSDP parameter group, in ``fsdp_modules`` order (they hold the int8 residuals)."""
        self.fsdp_modules: list[FSDPModule] = []
        """The FSDP modules holding parameters (each one FSDP parameter group), in ``modules()`` order."""
        self.pending_gradients = PendingGradients()
        """The reduce-scatters and replica syncs left in flight in the running backward (CPU)."""
        self.checkpoints = ShardedCheckpoints()
        state.register(
            "residuals",
            self._residuals,
            per_rank=True,
            active=self._residuals_held,
            load=self._load_residuals,
            words=("error-feedback residuals",),
        )
        state.register(
            "replica_sync",
            self._replica_sync_state,
            per_rank=True,
            active=self._replica_sync_holds,
            load=self.replica_sync.load_state_dict,
            words=("replica-sync compressor state",),
        )

    # -- mesh and communicators ---------------------------------------------------------------------
    @property
    def shard_comm(self) -> Communicator:
        """The communicator over this rank's shard group (FSDP's reduce-scatter goes through it)."""
        assert self._shard_comm is not None, "Sharded: no shard communicator before setup_environment"
        return self._shard_comm

    @property
    def replica_comm(self) -> Communicator:
        """The communicator over the ranks holding this rank's shard in every replica group."""
        assert self._replica_comm is not None, "Sharded: no replica communicator before setup_environment"
        return self._replica_comm

    def check(self, world_size: int) -> None:
        """Refuse, before the process group forms, ``replicas`` that do not divide ``world_size``."""
        if world_size % self.replicas:
            raise ValueError(
                f"replicas={self.replicas} must divide the world size {world_size} (devices x num_nodes); "
                f"accepted: {', '.join(str(r) for r in range(1, world_size + 1) if world_size % r == 0)}"
            )
        self.world_size = world_size

    def build(self, device_type: str, stats: CommStats, async_save: bool) -> ShardedMesh:
        """The mesh of the ``check``-ed ranks and the communicators over its groups (counted in
        ``stats``); with ``async_save``, the group of background checkpoint writes."""
        meshes = self.mesh = ShardedMesh.build(device_type, self.replicas, self.world_size // self.replicas)
        self._shard_comm = Communicator(TorchBackend(meshes.root.get_group("shard")), stats)
        self._replica_comm = Communicator(TorchBackend(meshes.root.get_group("replicate")), stats)
        if async_save:  # DCP's background writer coordinates over a group of its own
            self.checkpoints.group = meshes.root[MESH_DIMS]._flatten("checkpoint", "gloo").get_group()
        return meshes

    def close(self) -> None:
        """Drop collectives left in flight (a failed step's: a peer may be gone), finish a background
        checkpoint write, close the communicators."""
        self.pending_gradients.clear()
        self.checkpoints.wait()
        for comm in (self._shard_comm, self._replica_comm):
            if comm is not None:
                comm.close()

    # -- sharding and FSDP2's extension points ------------------------------------------------------
    def _shard_mesh(self) -> Any:
        assert self.mesh is not None, "Sharded: the mesh exists once setup_environment ran"
        return self.mesh.root["shard"]

    def shard(self, model: nn.Module) -> None:
        """Shard ``model`` (the user's ``fully_shard`` calls, or the default per-layer policy), refuse
        a layout that would train apart, and fill every FSDP module's extension points."""
        modules = fsdp_modules(model)
        if not modules:
            modules = shard_by_layer(model, self._shard_mesh())
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
            self.install(module, index)
        for module, reduce_scatter in zip(modules, self.reduce_scatters, strict=True):
            reduce_scatter.residual = residuals.get(id(module))
        logger.debug("Sharded: %d FSDP modules, hooks installed", len(modules))

    def _check_mesh(self, module: FSDPModule) -> None:
        """Refuse, before training, a module FSDP2 would not shard over this rank's shard group alone."""
        for group in module._get_fsdp_state()._fsdp_param_groups:
            refusal = mesh_refusal(
                group.mesh_info.mesh, self._shard_mesh(), self.replicas, type(module).__name__
            )
            if refusal is not None:
                raise ValueError(refusal)

    def install(self, module: FSDPModule, index: int) -> None:
        """Fill FSDP2's extension points of ``module`` (the ``index``-th FSDP module): the pack's
        all-gather and reduce-scatter over the shard group, and ``replica_hook``'s all-reduce hook."""
        landing = Landing.of(module, self.pending_gradients)
        reduce_scatter = PackReduceScatter(self.shard_comm, *self.reduce_scatter_options, landing=landing)
        module.set_custom_all_gather(PackAllGather(self.shard_comm))
        module.set_custom_reduce_scatter(reduce_scatter)
        self.reduce_scatters.append(reduce_scatter)
        hook = self.replica_hook(module, index)
        if hook is not None:
            module.set_all_reduce_hook(hook)

    def replica_hook(self, module: FSDPModule, index: int) -> Optional[Callable[[Tensor], None]]:
        """The hook FSDP2 calls with ``module``'s reduce-scattered shard gradient (flat, in place):
        the replica groups' sync (``ReplicaSync``), or None with one replica group or without
        ``replica_gradients``."""
        if self.replicas == 1 or not self.replica_gradients:
            return None
        return ReplicaSync(
            self.replica_comm,
            self.replica_sync,
            key=f"fsdp{index}",
            shards=shard_layout(module),
            adasum=self.adasum,
            reduce_scatter=self.reduce_scatters[index],
            pending=self.pending_gradients,
        )

    # -- this rank's own state (pieces of the strategy's StateRegistry) -----------------------------
    def _replica_sync_state(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        return to_cpu(self.replica_sync.state_dict())

    def _replica_sync_holds(self) -> bool:
        return bool(self.replica_sync.state_dict()["keys"])

    def _residuals(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        held = {str(i): rs.residual for i, rs in enumerate(self.reduce_scatters) if rs.residual is not None}
        return to_cpu(held)

    def _residuals_held(self) -> bool:
        return any(rs.residual is not None for rs in self.reduce_scatters)

    def _load_residuals(self, residuals: Mapping[str, Any]) -> None:
        for key, residual in residuals.items():  # moved to the gradients' device at their first use
            self.reduce_scatters[int(key)].residual = residual

    def describe(self) -> dict[str, Any]:
        """The layout a checkpoint was written at (per-rank state loads only at the same one)."""
        return {"world_size": self.world_size, "replicas": self.replicas}


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
