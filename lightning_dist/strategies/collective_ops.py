"""Lightning's reduce / all_gather / broadcast / barrier, answered by ``lightning_dist.collectives``.

Shared by every strategy so logging (``sync_dist=True``), metrics and checkpoint decisions cross
the same accounted transport as gradients.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import torch
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from typing_extensions import override

from lightning_dist import collectives
from lightning_dist.collectives.autograd import all_gather_with_grad
from lightning_dist.strategies.options import op_name

T = TypeVar("T")


def _check_group(method: str, group: Optional[Any]) -> None:
    """Every collective spans all ranks of the strategy's communicator: ``None`` and the default
    (world) group are that, and so is any group of exactly those ranks; a sub-group is refused."""
    if not collectives.spans(group):
        world = collectives.current().world_size
        raise ValueError(
            f"{method}(group={group!r}) is not supported: lightning_dist strategies reduce over all "
            f"{world} ranks of their communicator; accepted: group=None, torch.distributed.group.WORLD "
            "or a group of all those ranks (for sync_dist logging, leave sync_dist_group unset)"
        )


class CollectiveOpsMixin(Strategy):
    """Lightning's collective methods for a strategy; put it before the Lightning base class
    (``class DDP(CollectiveOpsMixin, DDPStrategy)``)."""

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[Tensor, Any]:
        _check_group("reduce", group)
        if not isinstance(tensor, Tensor):
            return tensor
        op = op_name(reduce_op, ("sum", "avg", "min", "max"), argument="reduce_op", default="avg")
        if op == "avg" and not tensor.is_floating_point():
            # Lightning truncates an integer mean back into the integer tensor; this returns it exactly
            return collectives.all_reduce(tensor.float(), op)
        return collectives.all_reduce(tensor, op)  # in place, as Lightning's DDPStrategy

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        _check_group("all_gather", group)
        if sync_grads:
            return all_gather_with_grad(collectives.current(), tensor)
        return torch.stack(collectives.all_gather(tensor.contiguous(), same_shape=True))

    @override
    def broadcast(self, obj: T, src: int = 0) -> T:
        return collectives.broadcast_object(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        collectives.barrier()
