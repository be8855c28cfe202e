"""``ShardedDiLoCo``: DiLoCo over FSDP2 shards (INTELLECT-1's layout).

    L.Trainer(devices=8, num_nodes=4, strategy=ShardedDiLoCo(inner_steps=100))   # a replica group per node
    L.Trainer(devices=4, strategy=ShardedDiLoCo(inner_steps=32, replicas=2, compression="int8"))
    L.Trainer(strategy="ld_sharded_diloco_int8")

The ranks form a ``(replicate, shard)`` mesh as ``Sharded``'s HSDP: each replica group trains its own
copy of the model, sharded over its ``shards`` ranks by FSDP2 (inner steps: plain FSDP, the
reduce-scatter inside the group, optionally compressed with ``shard_compression``), with no gradient
sync across replica groups. Every ``inner_steps`` optimizer steps each rank computes its own shard's
pseudo-gradient (last-sync shard - current shard) and averages it with the ranks that hold the same
shard in the other replica groups (``replica_comm``; optionally "fp16", "bf16" or "int8" on the wire,
counted in the strategy's ``CommStats``); an outer SGD (Nesterov momentum, ``diloco_outer.OuterSGD``)
steps the last-sync shard with it, and every replica group continues from the result. Only the syncs
cross replica groups: 1/``inner_steps`` of a ring all-reduce of one shard per optimizer step.
Floating-point buffers are averaged over all ranks at each sync (``sync_buffers``). A ``fit`` that
ends inside a period syncs the steps since the last sync, so every replica group ends on the same
weights (``diloco_tail``).

Checkpoints (the distributed checkpoint ``Sharded`` writes): the model entry holds the last-sync
weights (the same in every replica group, so resharding them is exact), the optimizer entry the inner
optimizer state; each rank's own current shard, inner optimizer state, last-sync shard, outer momentum
and pseudo-gradient compressor state go in its per-rank entry, and the step counters in the metadata.
A resume at the same layout continues exactly; one at another layout (world size or replicas)
continues every replica group from the last-sync weights, with the outer momentum, the steps since the
last sync and each replica group's own inner optimizer state dropped (a warning says so).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.algorithms.diloco_outer import OuterSGD
from lightning_dist.algorithms.diloco_params import inner_parameters
from lightning_dist.collectives import Communicator
from lightning_dist.compat import _PATH
from lightning_dist.compression import Compressor
from lightning_dist.layout.sharded_checkpoint import (
    like_param,
    local_optimizer_state,
    local_shard,
    restore_local_optimizer_state,
)
from lightning_dist.strategies.batch_shares import DILOCO_SHARES, refuse_shares
from lightning_dist.strategies.diloco_loop import DiLoCoLoop, build_diloco_compressor
from lightning_dist.strategies.options import option_names, options_from, reject_unknown_options
from lightning_dist.strategies.options_training import DiLoCoOptions
from lightning_dist.strategies.sharded import Sharded
from lightning_dist.warn import warn_once

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_dist.sharded_diloco"
"""In the checkpoint's metadata: ``{"inner_steps", "inner_step", "syncs"}``; each rank's own state is
in ``Sharded``'s per-rank entry under ``"diloco"``."""
SHARDED_PASSED_ON = (
    "int8_block_size",
    "error_feedback",
    "async_save",
    "save_distributed_checkpoint",
    "process_group_backend",
    "timeout",
)
"""``Sharded``'s keyword options that ``ShardedDiLoCo`` passes on as they are (its ``replica_sync`` and
``reduce_op`` do not apply: replica groups exchange pseudo-gradients)."""
DROPPED = (
    "DiLoCo's outer momentum",
    "the inner steps since the last sync (every replica group continues from the last-sync weights)",
    "each replica group's own inner optimizer state",
)


class ShardedDiLoCo(DiLoCoLoop, Sharded):
    """DiLoCo across replica groups, each training its own FSDP2-sharded copy (module docstring).

    Args:
        inner_steps, outer_lr, outer_momentum, nesterov, sync_buffers: as ``DiLoCo``'s, and its
            Streaming DiLoCo options ``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``
            (fragments of the shards: a fragment's shard on each rank).
        compression: the pseudo-gradients on the wire: None, ``"none"``, ``"fp16"``, ``"bf16"``,
            ``"int8"``, ``"int4"`` or ``"sparseloco"`` (or such a ``Compressor``).
        replicas: replica groups (DiLoCo's workers); each shards the model over world_size / replicas
            ranks. ``"auto"``: the number of nodes when there are several (one replica group per node,
            sharded over its devices), else the world size (no sharding: DiLoCo over ranks).
        shard_compression: the reduce-scatter inside a replica group (``Sharded``'s ``compression``).
        **sharded: ``Sharded``'s ``int8_block_size``, ``error_feedback``, ``async_save``,
            ``save_distributed_checkpoint``, ``process_group_backend`` and ``timeout``.
    """

    strategy_name = "ld_sharded_diloco"

    def __init__(
        self,
        inner_steps: int = 500,
        *,
        compression: Union[None, str, Compressor] = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        sync_buffers: bool = True,
        replicas: Union[int, Literal["auto"]] = "auto",
        shard_compression: Optional[str] = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        **sharded: Any,
    ) -> None:
        refuse_shares(type(self).__name__, sharded, DILOCO_SHARES)
        accepted = self._accepted_options()
        reject_unknown_options(
            type(self).__name__, {k: v for k, v in sharded.items() if k not in accepted}, accepted
        )
        streaming = options_from(DiLoCoOptions, locals()).streaming  # checks them
        if replicas != "auto" and (
            isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1
        ):
            raise ValueError(f"replicas={replicas!r} is not supported; accepted: 'auto' or an integer >= 1")
        self.compressor = build_diloco_compressor(compression)
        try:
            super().__init__(shard_compression, replicas=1 if replicas == "auto" else replicas, **sharded)
        except ValueError as error:  # Sharded's compression is ShardedDiLoCo's shard_compression
            raise ValueError(re.sub(r"\bcompression=", "shard_compression=", str(error))) from None
        self.layout.replica_gradients = False  # replica groups exchange pseudo-gradients instead
        self.training_state.register(
            "diloco",
            self._rank_state,
            per_rank=True,
            active=self._holds_rank_state,
            load=self._load_rank_state,
            words=DROPPED,
        )
        self._auto_replicas = replicas == "auto"
        self._init_loop(inner_steps, outer_lr, outer_momentum, nesterov, sync_buffers, streaming)
        self._names: dict[int, str] = {}
        self._restored = False

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        return [
            *option_names(DiLoCoOptions),
            "replicas",
            "shard_compression",
            *SHARDED_PASSED_ON,
        ]

    # -- mesh: no gradient sync across replica groups (the layout's replica_gradients) -------------
    @override
    def setup_environment(self) -> None:
        if self._auto_replicas:
            nodes, world = self.num_nodes, self.num_nodes * self.num_processes
            self.options.replicas = self.layout.replicas = nodes if nodes > 1 else world
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.lightning_module is not None
        named = inner_parameters("ShardedDiLoCo", self.lightning_module, self.optimizers)
        self._names = {id(p): n for n, p in named}
        self._same_start(named)
        self.diloco_sync.start(named, local=local_shard)  # a checkpoint's counters are loaded after setup
        self._restored = False

    def _same_start(self, named: list[tuple[str, Tensor]]) -> None:
        """Every replica group starts from replica group 0's shards (as DiLoCo from rank 0's weights)."""
        comm = self.replica_comm
        if comm.world_size == 1:
            return
        with torch.no_grad():
            for _, p in named:
                comm.broadcast(local_shard(p), 0)

    @override
    def pseudo_gradient_comm(self) -> Communicator:
        """The ranks holding this rank's shard in the other replica groups."""
        return self.replica_comm

    # -- checkpoints --------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model entry: the last-sync weights (the same in every replica group; a rank's current
        ones are in its own entry), buffers as they are."""
        state = super().lightning_module_state_dict()
        outer = self.outer
        if outer is None or not self._save_distributed_checkpoint:
            return state
        for name, param, anchor in zip(outer.names, outer.params, outer.anchors, strict=True):
            if name in state:
                state[name] = like_param(anchor.detach().to(param.dtype).cpu(), param)
        return state

    def _rank_state(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's current shard, inner optimizer state, outer state and compressor state."""
        outer = self.outer
        assert outer is not None
        with torch.no_grad():
            params = {n: t.detach().cpu().clone() for n, t in zip(outer.names, outer.tensors(), strict=True)}
        state = {
            "params": params,
            "optimizer": local_optimizer_state(self.optimizers[0], self._names),
            "outer": outer.state_dict(),
            "compressor": to_cpu(self.compressor.state_dict()),
        }
        if self.diloco_sync.streaming:  # an exchange in flight lands first, on every rank
            state["stream"] = self.diloco_sync.stream_state(self.replica_comm)
        return state

    def _holds_rank_state(self) -> bool:
        return self.outer is not None

    def _load_rank_state(self, own: Mapping[str, Any]) -> None:
        outer = self.outer
        if outer is None:
            return
        outer.load_state_dict(own["outer"])
        with torch.no_grad():
            for t, name in zip(outer.tensors(), outer.names, strict=True):
                t.copy_(own["params"][name])
        restore_local_optimizer_state(self.optimizers[0], self._names, own["optimizer"])
        self.compressor.load_state_dict(own["compressor"])
        if self.diloco_sync.streaming:
            self.diloco_sync.load_stream_state(own.get("stream"))
        self._restored = True

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if self.outer is not None:
            checkpoint[CHECKPOINT_KEY] = {
                "inner_steps": self.inner_steps,
                "inner_step": self.inner_step,
                "syncs": self.syncs,
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self._restored = False
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        outer = self.outer
        if outer is None:
            return checkpoint
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            warn_once(
                "ShardedDiLoCo: the checkpoint has no DiLoCo state (saved by another strategy); the outer "
                "state starts afresh from the loaded weights"
            )
        self.syncs = int(saved["syncs"]) if saved else 0
        if self._restored and saved is not None:
            self.inner_step = int(saved["inner_step"])
        else:  # the loaded weights are the last-sync ones (or another strategy's): the outer state from them
            self.outer = OuterSGD(
                list(zip(outer.names, outer.params)), self.outer_lr, self.outer_momentum, self.nesterov,
                local=local_shard,
            )  # fmt: skip
            self.inner_step = 0
            self.diloco_sync.reset_stream(moved=False)
        if saved is not None and saved.get("inner_steps") != self.inner_steps:
            logger.info(
                "ShardedDiLoCo: the checkpoint was saved with inner_steps=%s, this run has inner_steps=%d",
                saved.get("inner_steps"),
                self.inner_steps,
            )
        return checkpoint
