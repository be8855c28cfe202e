"""The transport interface every backend implements, and the names of reduction ops."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
from torch import Tensor
from torch.futures import Future

ReduceOp = Literal["sum", "avg", "min", "max", "adasum"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "min", "max", "adasum")


def check_reduce_op(op: str) -> str:
    """Normalise aliases (``mean`` -> ``avg``) and reject unknown ops with the accepted list."""
    name = str(op).lower()
    name = {"mean": "avg", "average": "avg", "add": "sum"}.get(name, name)
    if name not in REDUCE_OPS:
        raise ValueError(
            f"op={op!r} is not a reduction this library knows; accepted: {', '.join(REDUCE_OPS)}"
        )
    return name


def completed_future(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class Backend(ABC):
    """One transport (a torch process group, Horovod, or a single process).

    Methods start the operation and return a future; ``Communicator`` adds accounting and the
    blocking forms. Tensors are reduced/broadcast in place; gathers return new tensors.
    """

    name: str = "backend"

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str) -> Future:
        """Reduce ``tensor`` in place over ranks with ``op`` in sum/avg/min/max; future -> tensor."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        """Overwrite ``tensor`` on every rank with ``src``'s; future -> tensor."""

    @abstractmethod
    def all_gather(self, tensor: Tensor) -> Future:
        """Gather equal-shaped tensors; future -> list of tensors in rank order."""

    @abstractmethod
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        """``output`` on rank r becomes op-reduce of every rank's ``inputs[r]``; future -> output."""

    @abstractmethod
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        """Rank r sends ``inputs[j]`` to rank j, which stores it in ``outputs[r]``; future -> outputs."""

    @abstractmethod
    def send(self, tensor: Tensor, dst: int) -> Future:
        """Point-to-point send (used by Adasum's exchange); future -> tensor."""

    @abstractmethod
    def recv(self, tensor: Tensor, src: int) -> Future:
        """Point-to-point receive into ``tensor``; future -> tensor."""

    @abstractmethod
    def barrier(self) -> None: ...

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Broadcast a picklable object; the default pickles into a byte tensor."""
        import pickle

        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size = self.broadcast(self._to_device(size), src).wait().cpu()
        buf = payload if self.rank == src else torch.empty(int(size.item()), dtype=torch.uint8)
        buf = self.broadcast(self._to_device(buf), src).wait().cpu()
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())

    def _to_device(self, tensor: Tensor) -> Tensor:
        """Where control-plane tensors must live for this transport (CPU unless NCCL)."""
        return tensor
