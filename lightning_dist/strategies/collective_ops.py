"""Lightning's reduce / all_gather / broadcast / barrier, answered by ``lightning_dist.collectives``.

Shared by every strategy so logging (``sync_dist=True``), metrics and checkpoint decisions cross
the same accounted transport as gradients.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import torch
from torch import Tensor

from lightning_dist import collectives
from lightning_dist.collectives.autograd import all_gather_with_grad
from lightning_dist.strategies.options import reduce_op_name

T = TypeVar("T")


class CollectiveOpsMixin:
    """Mixin for a Lightning ``Strategy``; put it before the Lightning base class."""

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[Tensor, Any]:
        if not isinstance(tensor, Tensor):
            return tensor
        op = reduce_op_name("reduce_op", reduce_op, ("sum", "avg", "min", "max"))
        result = tensor.clone()
        if op == "avg" and not result.is_floating_point():
            result = result.float()
        return collectives.all_reduce(result, op)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if sync_grads:
            return all_gather_with_grad(collectives.current(), tensor)
        return torch.stack(collectives.all_gather(tensor.contiguous(), same_shape=True))

    def broadcast(self, obj: T, src: int = 0) -> T:
        return collectives.broadcast_object(obj, src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        collectives.barrier()
