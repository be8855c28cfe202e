"""All-gather that passes gradients back to their source rank (for ``all_gather(sync_grads=True)``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dist.collectives.communicator import Communicator


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, comm: Communicator) -> Tensor:
        ctx.comm = comm
        return torch.stack(comm.all_gather(tensor.contiguous(), same_shape=True))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        comm: Communicator = ctx.comm
        grad = grad.contiguous()
        comm.all_reduce(grad, "sum")
        return grad[comm.rank], None


def all_gather_with_grad(comm: Communicator, tensor: Tensor) -> Tensor:
    """Stack every rank's ``tensor`` (shape ``(world, *shape)``); backward sums the gradients."""
    return _AllGatherWithGrad.apply(tensor, comm)
