"""``DiLoCo``: local optimizer steps on every rank, then an outer Nesterov step on the averaged change.

    L.Trainer(strategy=DiLoCo(inner_steps=500))                 # outer_lr=0.7, outer_momentum=0.9
    L.Trainer(strategy=DiLoCo(inner_steps=100, compression="int8"))
    L.Trainer(strategy="diloco")

Each rank steps its own optimizer (the inner one: AdamW, anything) on its own data for ``inner_steps``
optimizer steps, with no gradient exchange. Then the ranks average the pseudo-gradient
``params_at_last_sync - params`` (optionally compressed: "fp16", "bf16", "int8", through the same
exchange driver as ``Compressed``), an outer SGD (Nesterov momentum) steps the last-sync parameters
with it, and every rank continues from the result; floating-point buffers (BatchNorm statistics) are
averaged too. Only the syncs send parameter-sized data: 1/``inner_steps`` of a ring all-reduce per
optimizer step (DiLoCo, Douillard et al. 2023, arXiv:2311.08105).

When ``fit`` ends inside a period (``max_steps`` or the epochs' optimizer steps not a multiple of
``inner_steps``, or a ``trainer.should_stop``), one more sync over the steps since the last one (the
same outer step) ends every rank on the same weights, before the last validation and checkpoints
(``diloco_tail``); the next ``fit`` from there counts a new period.

Between syncs every rank's weights and inner optimizer state differ. A checkpoint therefore holds every
rank's model and inner optimizer state besides Lightning's rank-0 copy, plus the last-sync parameters,
the outer momentum and the inner-step counter (``CHECKPOINT_KEY``); a run resumed from a checkpoint
saved inside ``fit`` (``ModelCheckpoint``) loads its own rank's and continues exactly. One from
another world size (or without that entry) starts every rank from the last-sync parameters (or rank
0's weights) with rank 0's inner optimizer state, with a warning.
Checkpoints must be saved on every rank (``trainer.save_checkpoint``, as ``ModelCheckpoint`` does).
Validation inside ``fit`` sees each rank's current weights (the local ones between syncs; make
``val_check_interval`` a multiple of ``inner_steps`` to evaluate the synced model).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.algorithms.diloco_params import inner_parameters
from lightning_dist.compression import Compressor
from lightning_dist.state import RankStates
from lightning_dist.strategies.ddp import DDP
from lightning_dist.strategies.diloco_loop import DiLoCoLoop, build_diloco_compressor
from lightning_dist.strategies.options import option_names, options_from, reject_unknown_options
from lightning_dist.strategies.options_training import (
    STREAMING_OPTIONS,
    DiLoCoOptions,
    LaunchOptions,
    SharesOptions,
)
from lightning_dist.strategies.rank_state import RankStateMixin

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_dist.diloco"
"""Checkpoint entry: ``{"world_size": W, "ranks": [rank r's {"state_dict", "optimizer_states",
"compressor", and with Streaming DiLoCo "stream": DiLoCoSync.stream_state()}], "outer":
OuterSGD.state_dict(), "inner_step": int, "syncs": int, "inner_steps": H}``."""
DILOCO_STATES = RankStates(
    CHECKPOINT_KEY, "DiLoCo", "the checkpoint has no DiLoCo state (saved by another strategy)"
)


class DiLoCo(RankStateMixin, DiLoCoLoop, DDP):
    """DiLoCo: ``inner_steps`` local optimizer steps per rank, then an averaged outer Nesterov step.

    Args:
        inner_steps: optimizer steps between syncs (H); with gradient accumulation, optimizer steps,
            not micro-batches.
        outer_lr: the outer SGD's learning rate (1.0 with ``outer_momentum=0``: plain parameter averaging).
        outer_momentum: the outer SGD's momentum, in [0, 1).
        nesterov: Nesterov momentum for the outer SGD (ignored when ``outer_momentum`` is 0).
        compression: None, "none", "fp16", "bf16", "int8", "int4" or "sparseloco" (or such a
            ``Compressor``): how the pseudo-gradients cross the wire (``docs/wire-formats-lowbit.md``).
        sync_buffers: average floating-point buffers (BatchNorm statistics) at every sync.
        accelerator ... start_method: as ``DDP``'s (``start_method="auto"``: fork in notebooks).
        fragments, fragment_sync_delay, fragment_update_alpha: Streaming DiLoCo's P, tau and alpha
            (``lightning_dist.sync.diloco``; docs/low-communication.md); 1, 0, 0: DiLoCo.
        shares: each rank's share of the global batch, as ``DDP``'s; inner steps train on the share
            unweighted, and each rank's pseudo-gradient is weighed by the samples it trained.
    """

    strategy_name = "ld_diloco"

    def __init__(
        self,
        inner_steps: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compression: Union[None, str, Compressor] = None,
        sync_buffers: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "auto",
        shares: Any = None,
        *,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        **unknown: Any,
    ) -> None:
        reject_unknown_options(type(self).__name__, unknown, self._accepted_options())
        streaming = options_from(DiLoCoOptions, locals()).streaming  # checks them
        self.compressor = build_diloco_compressor(compression)
        super().__init__(**options_from(LaunchOptions, locals()).as_kwargs())
        self._init_loop(inner_steps, outer_lr, outer_momentum, nesterov, sync_buffers, streaming)
        self._init_shares(options_from(SharesOptions, locals()).shares)
        if self.batch_shares is not None:  # inner steps are local: the pseudo-gradients are weighed
            self.batch_shares.weigh_loss = False
        self._restored_per_rank = False
        self.training_state.register(
            "diloco",
            self._own_state,
            per_rank=True,
            checkpoint=DILOCO_STATES,
            fields=self._entry_fields,
            active=self._started,
        )

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        return [
            *option_names(DiLoCoOptions, LaunchOptions, SharesOptions, without=STREAMING_OPTIONS),
            *STREAMING_OPTIONS,
        ]

    # -- setup: no DistributedDataParallel, rank 0's weights everywhere -----------------------------
    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel (no gradient sync); every rank starts from rank 0's weights,
        unless each rank's own weights were just restored from a checkpoint."""
        assert self.model is not None
        if not self._restored_per_rank:
            comm = self._transport()
            with torch.no_grad():
                for t in [*self.model.parameters(), *self.model.buffers()]:
                    comm.broadcast(t.detach(), 0)
        self._restored_per_rank = False
        logger.debug("DiLoCo: no DistributedDataParallel; inner_steps=%d", self.inner_steps)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.lightning_module is not None
        # a checkpoint's counters are loaded after setup
        self.diloco_sync.start(inner_parameters("DiLoCo", self.lightning_module, self.optimizers))

    # -- checkpoints: every rank's model and inner optimizer state, and the outer state --------------
    def _own_state(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's weights and inner optimizer state (from ``checkpoint``) and compressor state."""
        state = {
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": list(checkpoint["optimizer_states"]),
            "compressor": self.compressor.state_dict(),
        }
        if self.diloco_sync.streaming:  # an exchange in flight lands first, on every rank
            state["stream"] = self.diloco_sync.stream_state(self.pseudo_gradient_comm())
        return to_cpu(state)

    def _started(self) -> bool:
        return self.outer is not None

    def _entry_fields(self) -> dict[str, Any]:
        """The replicated fields of DiLoCo's checkpoint entry: the counters and the outer state."""
        assert self.outer is not None, "DiLoCo: setup() has not run"
        return {
            "inner_steps": self.inner_steps,
            "inner_step": self.inner_step,
            "syncs": self.syncs,
            "outer": self.outer.state_dict(),
        }

    def checkpoint_entry(self, checkpoint: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """``{CHECKPOINT_KEY: ...}`` on rank 0, {} on the others: every rank's weights, inner optimizer
        and compressor state, and the outer state. Each rank's weights and optimizer states come from
        ``checkpoint`` (the one it dumped) or, without one, from its module and optimizer. A
        collective: every rank calls it."""
        assert self.outer is not None, "DiLoCo.checkpoint_entry: setup() has not run"
        if checkpoint is None:
            checkpoint = {
                "state_dict": self.lightning_module_state_dict(),
                "optimizer_states": [self.optimizer_state(opt) for opt in self.optimizers],
            }
        ranks = self.gather_rank_states(checkpoint)  # the registry's pieces, as save_checkpoint gathers
        return {} if ranks is None else self.rank_state_entries(ranks, checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        self._restored_per_rank = False
        if saved is not None and DILOCO_STATES.problem(saved, self.world_size) is None:
            checkpoint = {**checkpoint, "state_dict": saved["ranks"][self.global_rank]["state_dict"]}
            self._restored_per_rank = True
        elif saved is not None:  # another world size: every rank starts from the last-sync parameters
            checkpoint = {
                **checkpoint,
                "state_dict": {**checkpoint["state_dict"], **saved["outer"]["anchors"]},
            }
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this rank's inner optimizer state and the outer state (see the module docstring)."""
        saved = checkpoint.get(CHECKPOINT_KEY)
        own = DILOCO_STATES.select(
            saved,
            self.global_rank,
            self.world_size,
            fallback="every rank continues from the same weights with rank 0's inner optimizer state, so the "
            "resumed run does not continue exactly as an uninterrupted one would",
        )
        if own is not None:
            checkpoint = {**checkpoint, "optimizer_states": own["optimizer_states"]}
            self.compressor.load_state_dict(own["compressor"])
        super().load_optimizer_state_dict(checkpoint)
        outer = self.outer
        if outer is None or saved is None:
            return
        outer.load_state_dict(saved["outer"])
        self.syncs = int(saved["syncs"])
        if own is not None:
            self.inner_step = int(saved["inner_step"])
            if self.diloco_sync.streaming:
                self.diloco_sync.load_stream_state(own.get("stream"))
        else:  # the steps since the last sync are dropped: every rank restarts from the last-sync params
            outer.copy_to_model()
            self.inner_step = 0
        if saved.get("inner_steps") != self.inner_steps:
            logger.info(
                "DiLoCo: the checkpoint was saved with inner_steps=%s, this run has inner_steps=%d: the "
                "outer state and the %d inner steps since the last sync carry over, and syncs now come "
                "every %d optimizer steps; pass DiLoCo(inner_steps=%s) to keep the saved schedule",
                saved.get("inner_steps"),
                self.inner_steps,
                self.inner_step,
                self.inner_steps,
                saved.get("inner_steps"),
            )
