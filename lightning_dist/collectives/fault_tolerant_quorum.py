"""Collectives over every process of a live-recovery quorum: ``G`` processes in each of the quorum's
groups, process ``g`` of participant ``p`` being rank ``p x G + g``. Each crosses the groups on the
lane of process ``g`` (the Manager's collectives among the groups' processes ``g``: ``lane``) and the
group on its own process group (``group``). What Lightning's reduce, all_gather, broadcast and
barrier answer for ``FaultTolerant`` with several processes per group."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives.backend import Backend
from lightning_dist.collectives.communicator import Communicator
from lightning_dist.collectives.futures import completed_future


class QuorumBackend(Backend):
    """The quorum's processes as one world over ``lane`` (across the groups) and ``group`` (in it)."""

    name = "torchft-quorum"

    def __init__(self, lane: Communicator, group: Communicator) -> None:
        self.lane, self.group = lane, group

    @property
    @override
    def rank(self) -> int:
        return self.lane.rank * self.group.world_size + self.group.rank

    @property
    @override
    def world_size(self) -> int:
        return self.lane.world_size * self.group.world_size

    @property
    @override
    def device_type(self) -> str:
        return self.group.backend.device_type

    @override
    def all_reduce(self, tensor: Tensor, op: str, name: Optional[str] = None) -> Future:
        if op == "avg":
            tensor.div_(self.world_size)  # divide first, then sum, as TorchBackend does
        inner = "sum" if op == "avg" else op
        self.lane.all_reduce(self.group.all_reduce(tensor, inner), inner)
        return completed_future(tensor)

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        # every group gets process src % G's copy from group src // G on that lane, then spreads it
        p, g = divmod(src, self.group.world_size)
        self.lane.broadcast(tensor, p)
        return completed_future(self.group.broadcast(tensor, g))

    @override
    def all_gather(self, tensor: Tensor) -> Future:
        across = torch.stack(self.lane.all_gather(tensor, same_shape=True))  # [p] for this process g
        within = self.group.all_gather(across, same_shape=True)  # [g][p]
        return completed_future(
            [within[g][p] for p in range(self.lane.world_size) for g in range(len(within))]
        )

    @override
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        raise NotImplementedError("QuorumBackend: reduce_scatter (Lightning's collectives need none)")

    @override
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        raise NotImplementedError("QuorumBackend: all_to_all (Lightning's collectives need none)")

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        raise NotImplementedError("QuorumBackend: send (Lightning's collectives need none)")

    @override
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        raise NotImplementedError("QuorumBackend: recv (Lightning's collectives need none)")

    @override
    def barrier(self) -> None:
        self.group.barrier()
        self.lane.barrier()
        self.group.barrier()
