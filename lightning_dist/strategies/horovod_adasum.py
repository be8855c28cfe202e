"""``HorovodAdasum``: Horovod's MPI Adasum of optimizer *updates*, as Horovod's own optimizer does it.

Each rank's optimizer steps on its own gradients; the updates u_r = p_new - p_start are combined with
Adasum and every rank continues from p_start + Adasum(u_0, ..., u_{W-1}). For adaptive optimizers
(Adam, LAMB) this differs from Adasum of the gradients; for plain SGD the two coincide.

Each rank's optimizer state (Adam's moments, momentum buffers) therefore differs between ranks.
Checkpoints hold every rank's optimizer state (``CHECKPOINT_KEY``) besides Lightning's rank-0 copy, and
a resumed run loads its own rank's, so it continues as if never stopped. A checkpoint from another world
size, or one without that entry, loads rank 0's state on every rank (with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.collectives import Communicator
from lightning_dist.compression import Compressor
from lightning_dist.state import RankStates
from lightning_dist.strategies.horovod_base import HOROVOD_OPTIONS, HorovodBase
from lightning_dist.strategies.launch_needs import MPI_ADASUM
from lightning_dist.strategies.options import normalize_op, reject_unknown_options
from lightning_dist.strategies.rank_state import RankStateMixin

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_dist.horovod_adasum"
"""Checkpoint entry: ``{"world_size": W, "ranks": [rank r's optimizer_states, for r < W]}``."""
OPTIMIZER_STATES = RankStates(
    CHECKPOINT_KEY,
    "HorovodAdasum",
    "the checkpoint has no per-rank optimizer states (saved by an older version or another strategy)",
)


class HorovodAdasum(RankStateMixin, HorovodBase):
    """Horovod's MPI Adasum of optimizer updates (launch with MPI: ``horovodrun --mpi``, ``mpirun``,
    ``srun --mpi=pmix``). ``lr_scale="auto"`` scales the learning rate by the local size on GPUs and
    leaves it on CPUs, as Horovod advises for Adasum.

    Between optimizer steps parameters must change only through the optimizer: the starting point of
    each update is kept from the previous step (reset when a checkpoint is loaded).

    Checkpoints must be saved on every rank (``trainer.save_checkpoint``, as ``ModelCheckpoint`` does):
    each rank's optimizer state is gathered to rank 0, which writes them all.
    """

    strategy_name = "ld_horovod_adasum"
    launch_needs = MPI_ADASUM

    def __init__(
        self,
        op: str = "adasum",
        compression: Union[None, str, Compressor] = None,
        lr_scale: Union[str, float] = "auto",
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **unknown: Any,
    ) -> None:
        """Arguments as ``Horovod``'s (``lr_scale``, ``accelerator`` ...); ``op`` must stay "adasum"
        and ``compression`` None: Adasum combines full-precision updates."""
        if normalize_op(op) != "adasum":
            raise ValueError(f"op={op!r}: HorovodAdasum always uses 'adasum'; use Horovod(op=...) instead")
        if compression not in (None, "none"):
            raise ValueError(
                f"compression={compression!r} is not supported with op='adasum'; accepted there: None, 'none'"
            )
        reject_unknown_options(type(self).__name__, unknown, HOROVOD_OPTIONS)
        super().__init__(lr_scale, accelerator, checkpoint_io, precision_plugin)
        self.training_state.register(
            "optimizer_states", self._optimizer_states_piece, per_rank=True, checkpoint=OPTIMIZER_STATES
        )
        self.op = "adasum"
        self.compression = None
        self.compressor = None
        self._start: dict[int, list[Tensor]] = {}
        """Per optimizer: the parameters as the last Adasum step left them (each update's origin)."""

    @override
    def _check_configuration(self, trainer: L.Trainer) -> None:
        precision = str(trainer.precision)
        if "16" in precision and "bf16" not in precision:
            raise ValueError(
                f"precision={trainer.precision!r} is not supported with op='adasum' (fp16 Adasum loses the "
                "updates' scale); accepted: '32-true', 'bf16-mixed', 'bf16-true'"
            )
        self.backend.check_all_reduce("adasum", self.root_device.type)

    @override
    def _setup_step_sync(self) -> None:
        self._start.clear()  # no gradient hooks: each rank steps on its own gradients
        logger.debug("HorovodAdasum: optimizer updates combined with Adasum after every step")

    @override
    def _auto_lr_scale(self) -> float:
        return float(self.backend.local_size) if self.root_device.type == "cuda" else 1.0

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        start = self._start.get(id(optimizer))
        if start is None:
            start = self._start[id(optimizer)] = [p.detach().clone() for p in params]
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        with torch.no_grad():
            updates = [p.detach() for p in params]
            torch._foreach_sub_(updates, start)  # each parameter now holds its update
            self._transport().all_reduce(updates, "adasum")
            torch._foreach_add_(updates, start)
            torch._foreach_copy_(start, updates)
        return result

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self._start.clear()

    # -- checkpoints: every rank's optimizer state (lightning_dist.strategies.rank_state) ------------
    @override
    def rank_state_comm(self) -> Communicator:
        return self._backend_communicator()  # after ``fit`` too (``trainer.save_checkpoint``)

    def _optimizer_states_piece(self, checkpoint: Mapping[str, Any]) -> list[Any]:
        return to_cpu(list(checkpoint["optimizer_states"]))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this rank's own optimizer states (rank 0's, with a warning, when the checkpoint has none
        for this world size)."""
        own = OPTIMIZER_STATES.select(
            checkpoint.get(CHECKPOINT_KEY),
            self.global_rank,
            self.world_size,
            fallback="every rank loads rank 0's optimizer state, so the resumed run does not continue "
            "exactly as an uninterrupted one would",
        )
        if own is not None:
            checkpoint = {**checkpoint, "optimizer_states": own}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def teardown(self) -> None:
        self._start.clear()
        super().teardown()
