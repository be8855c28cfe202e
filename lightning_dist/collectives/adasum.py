"""Adasum over any point-to-point capable backend (placeholder until the Adasum issue lands)."""

from __future__ import annotations

from torch import Tensor

from lightning_dist.collectives.communicator import Communicator, register_adasum


def adasum_all_reduce(comm: Communicator, tensors: list[Tensor]) -> list[Tensor]:
    raise NotImplementedError("op='adasum' over torch.distributed is not implemented yet")


register_adasum(adasum_all_reduce)
