"""``HorovodAdasum``: Horovod's MPI Adasum of optimizer *updates*, as Horovod's own optimizer does it.

Each rank's optimizer steps on its own gradients; the updates u_r = p_new - p_start are combined with
Adasum and every rank continues from p_start + Adasum(u_0, ..., u_{W-1}). For adaptive optimizers
(Adam, LAMB) this differs from Adasum of the gradients; for plain SGD the two coincide.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist import collectives
from lightning_dist.compression import Compressor
from lightning_dist.strategies.horovod import Horovod

logger = logging.getLogger(__name__)

ADASUM_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "64-true")


class HorovodAdasum(Horovod):
    """Horovod's MPI Adasum of optimizer updates (launch with MPI: ``horovodrun --mpi``, ``mpirun``,
    ``srun --mpi=pmix``). ``lr_scale="auto"`` scales the learning rate by the local size on GPUs and
    leaves it on CPUs, as Horovod advises for Adasum.

    Between optimizer steps parameters must change only through the optimizer: the starting point of
    each update is kept from the previous step (reset when a checkpoint is loaded).
    """

    strategy_name = "horovod_adasum"

    def __init__(
        self,
        op: str = "adasum",
        compression: Union[None, str, Compressor] = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Arguments as ``Horovod``'s (``lr_scale``, ``accelerator`` ...); ``op`` must stay "adasum"
        and ``compression`` None: Adasum combines full-precision updates."""
        if op != "adasum":
            raise ValueError(f"op={op!r}: HorovodAdasum always uses 'adasum'; use Horovod(op=...) instead")
        if compression not in (None, "none"):
            raise ValueError(
                f"compression={compression!r} is not supported with op='adasum'; accepted there: None, 'none'"
            )
        super().__init__("adasum", None, *args, **kwargs)
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
    def _setup_gradient_sync(self) -> None:
        self._start.clear()  # no gradient hooks: each rank steps on its own gradients
        logger.debug("HorovodAdasum: optimizer updates combined with Adasum after every step")

    @override
    def lr_scale_factor(self) -> float:
        if self.lr_scale != "auto":
            return float(self.lr_scale)
        return float(self.backend.local_size) if self.root_device.type == "cuda" else 1.0

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        start = self._start.get(id(optimizer))
        if start is None:
            start = self._start[id(optimizer)] = [p.detach().clone() for p in params]
        result = super(Horovod, self).optimizer_step(optimizer, closure, model, **kwargs)
        with torch.no_grad():
            updates = [p.detach() for p in params]
            torch._foreach_sub_(updates, start)  # each parameter now holds its update
            collectives.all_reduce(updates, "adasum")
            torch._foreach_add_(updates, start)
            torch._foreach_copy_(start, updates)
        return result

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self._start.clear()

    @override
    def teardown(self) -> None:
        self._start.clear()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("horovod_adasum", cls, description="lightning_dist Horovod with Adasum")
