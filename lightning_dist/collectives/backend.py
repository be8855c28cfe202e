"""The transport interface every backend implements (the names of reduction ops are ``ops.py``'s)."""

from __future__ import annotations

import math
import pickle
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives.accounting import ring_all_reduce_bytes
from lightning_dist.collectives.ops import REDUCE_OPS, ReduceOp, check_reduce_op  # noqa: F401  (the op names' home)


def rows(t: Tensor) -> int:
    """The first dimension as an all-to-all's split sizes count it (a 0-d tensor is one row)."""
    return t.shape[0] if t.dim() else 1


def cat_rows(tensors: list[Tensor]) -> Tensor:
    """``tensors`` concatenated as rows of one 2-d tensor (the send buffer of an all-to-all)."""
    return torch.cat([t.reshape(rows(t), math.prod(t.shape[1:])) for t in tensors])


def split_rows(received: Tensor, outputs: list[Tensor]) -> list[Tensor]:
    """Copy the rows of ``received`` into ``outputs``, in order; returns ``outputs``."""
    for out, part in zip(outputs, received.split([rows(t) for t in outputs]), strict=True):
        out.copy_(part.reshape(out.shape))
    return outputs


def group_ranks(group: Any) -> Optional[list[int]]:
    """The global ranks of a ``torch.distributed`` group, in its rank order; ``None`` where torch
    cannot tell (no default process group, or a group object torch did not register)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, KeyError, AttributeError, TypeError):
        return None


class Backend(ABC):
    """One transport (a torch process group, Horovod, or a single process).

    Methods start the operation and return a future; ``Communicator`` adds accounting, call order
    and the blocking forms. Tensors are reduced/broadcast in place; gathers return new tensors.
    """

    name: str = "backend"

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    def spans(self, group: Any) -> bool:
        """Whether ``group`` (a ``torch.distributed`` group a caller names, ``None`` for "all")
        holds exactly this transport's ranks, so a collective over this transport answers for it.
        The default: this transport's ranks are the global ranks 0..world_size-1."""
        return group is None or group_ranks(group) == list(range(self.world_size))

    def check_all_reduce(self, op: str, device_type: str) -> None:
        """Raise (the same error on every rank) when this job cannot all-reduce with ``op`` on
        ``device_type`` tensors; called before training starts. The default accepts every op."""
        return None

    @property
    def device_type(self) -> str:
        """Device type of the tensors this transport moves (``cuda`` for NCCL, else ``cpu``)."""
        return "cpu"

    def to_transport_device(self, tensor: Tensor) -> Tensor:
        """``tensor`` where this transport needs it: for control tensors (shapes, lengths, pickled
        objects) that are made on the CPU."""
        if tensor.device.type == self.device_type:
            return tensor
        if self.device_type == "cuda":
            return tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor.to(self.device_type)

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str, name: Optional[str] = None) -> Future:
        """Reduce ``tensor`` in place over ranks with ``op`` in sum/avg/min/max; future -> tensor.

        ``name``: the same on every rank and at every step for the same tensor, for transports that
        cache their negotiation by name (Horovod's response cache); others ignore it."""

    def all_reduce_bytes(self, nbytes: int, dtype: torch.dtype) -> int:
        """Bytes this rank sends (and receives) in ``all_reduce`` of ``nbytes`` of ``dtype``; the
        default is a ring all-reduce."""
        return ring_all_reduce_bytes(nbytes, self.world_size)

    def native_adasum(self, tensors: list[Tensor]) -> Optional[tuple[int, int]]:
        """The transport's own Adasum of ``tensors`` in place, returning the bytes this rank sent and
        received (its communicator counts them); ``None`` (the default) means it has none and the
        library's Adasum (``adasum.adasum_all_reduce``) runs instead."""
        return None

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        """Overwrite ``tensor`` on every rank with ``src``'s; future -> tensor."""

    @abstractmethod
    def all_gather(self, tensor: Tensor) -> Future:
        """Gather equal-shaped tensors; future -> list of tensors in rank order."""

    def all_gather_into(self, output: Tensor, tensor: Tensor) -> Future:
        """Gather equal-shaped tensors into ``output`` (W times ``tensor``'s elements, rank after
        rank): FSDP2's parameter all-gather. By default through ``all_gather`` and a copy; a
        backend with a native one overrides it. Future -> output."""
        chunks = output.view(self.world_size, -1).unbind(0)

        def _copy(fut: Future) -> Tensor:
            for chunk, part in zip(chunks, fut.value(), strict=True):
                chunk.copy_(part.reshape(-1))
            return output

        return self.all_gather(tensor).then(_copy)

    @abstractmethod
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        """``output`` on rank r becomes op-reduce of every rank's ``inputs[r]``; future -> output."""

    @abstractmethod
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        """Rank r sends ``inputs[j]`` to rank j, which stores it in ``outputs[r]``; future -> outputs."""

    @property
    def independent_tags(self) -> bool:
        """Whether send/recv on different tags may run from different threads at once, each tag's
        messages matched in their own order (Gloo); not where a pair's operations are serialised
        (NCCL), nor by default."""
        return False

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        """Point-to-point send, matched with the ``recv`` of the same ``tag``; future -> tensor."""

    @abstractmethod
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        """Point-to-point receive into ``tensor``; future -> tensor."""

    @abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:
        """Stop the helper threads this backend started, once their work is done (they restart on
        demand); the transport itself stays usable. The default has none."""
        return None

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Broadcast a picklable object; the default pickles into a byte tensor."""
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size = self.broadcast(self.to_transport_device(size), src).wait().cpu()
        buf = payload if self.rank == src else torch.empty(int(size.item()), dtype=torch.uint8)
        buf = self.broadcast(self.to_transport_device(buf), src).wait().cpu()
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())
