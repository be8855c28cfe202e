"""``Communicator``: the collectives API over one backend, with byte/time accounting on every call.

Wire model for the byte counters (per rank, N = payload bytes, W = world size):
  all_reduce      ring: sends and receives 2*(W-1)*N // W
  broadcast       the source sends (W-1)*N, every other rank receives N
  all_gather      sends (W-1)*N_own, receives the sum of the others' N (uneven: padded sizes, plus
                  the int64 shape exchange)
  reduce_scatter  sends and receives (W-1)*N // W of its N-byte input
  all_to_all      sends the chunks addressed to other ranks, receives the chunks from them
  adasum          what the recursive halving/doubling exchange really sends (see adasum.py)
At world size 1 every count is zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives.accounting import CommStats, ring_all_reduce_bytes
from lightning_dist.collectives.backend import Backend, check_reduce_op, completed_future

TensorOrList = Union[Tensor, Sequence[Tensor]]
AdasumFn = Callable[["Communicator", list[Tensor]], list[Tensor]]

PROCESS_STATS = CommStats()
"""Counters shared by every communicator made without its own ``stats`` in this process."""

_ADASUM_IMPL: Optional[AdasumFn] = None


def register_adasum(fn: AdasumFn) -> None:
    """Install the Adasum reduction used for ``op="adasum"`` on backends without a native one."""
    global _ADASUM_IMPL
    _ADASUM_IMPL = fn


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class Communicator:
    """All collectives over one ``Backend``; counts bytes and seconds into ``stats``."""

    def __init__(self, backend: Backend, stats: Optional[CommStats] = None) -> None:
        self.backend = backend
        self.stats = PROCESS_STATS if stats is None else stats

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    # -- accounting -------------------------------------------------------------------------
    def _account(self, op: str, sent: int, received: int, fut: Future) -> Future:
        if self.world_size <= 1:
            sent = received = 0
        start = time.perf_counter()
        stats = self.stats
        stats.add(op, sent, received)

        # The callback must not hold the communicator: if it dropped the last reference to a
        # process group inside that group's own worker thread, the group's destructor would abort.
        def _done(f: Future) -> Any:
            stats.add_time(op, time.perf_counter() - start)
            return f.value()

        return fut.then(_done)

    def count(self, op: str, sent: int, received: int, seconds: float = 0.0) -> None:
        """Add bytes moved by a caller-driven exchange (compound algorithms such as Adasum)."""
        if self.world_size > 1:
            self.stats.add(op, sent, received, seconds)

    # -- all_reduce -------------------------------------------------------------------------
    def all_reduce_async(self, tensor: TensorOrList, op: str = "sum") -> Future:
        """Reduce in place; a list is reduced as one fused buffer (Adasum: per tensor)."""
        op = check_reduce_op(op)
        tensors = [tensor] if isinstance(tensor, Tensor) else list(tensor)
        single = isinstance(tensor, Tensor)
        if self.world_size == 1:
            return completed_future(tensor if single else tensors)
        if op == "adasum":
            reduced = self._adasum(tensors)
            return completed_future(reduced[0] if single else reduced)
        if single:
            t = tensors[0]
            fut = self.backend.all_reduce(t, op)
            nbytes = ring_all_reduce_bytes(_nbytes(t), self.world_size)
            return self._account("all_reduce", nbytes, nbytes, fut)
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        nbytes = ring_all_reduce_bytes(_nbytes(flat), self.world_size)

        def _unflatten(f: Future) -> list[Tensor]:
            out = f.value()
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(out[offset : offset + n].view_as(t))
                offset += n
            return tensors

        return self._account("all_reduce", nbytes, nbytes, self.backend.all_reduce(flat, op)).then(_unflatten)

    def all_reduce(self, tensor: TensorOrList, op: str = "sum") -> Any:
        return self.all_reduce_async(tensor, op).wait()

    def _adasum(self, tensors: list[Tensor]) -> list[Tensor]:
        native = getattr(self.backend, "adasum", None)
        if native is not None:
            return native(self, tensors)
        if _ADASUM_IMPL is None:
            import lightning_dist.collectives.adasum  # noqa: F401  (registers the implementation)
        assert _ADASUM_IMPL is not None
        return _ADASUM_IMPL(self, tensors)

    # -- broadcast ----------------------------------------------------------------------------
    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Future:
        if self.world_size == 1:
            return completed_future(tensor)
        n = _nbytes(tensor)
        sent, received = ((self.world_size - 1) * n, 0) if self.rank == src else (0, n)
        return self._account("broadcast", sent, received, self.backend.broadcast(tensor, src))

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        return self.broadcast_async(tensor, src).wait()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast any picklable object from ``src``; counted as its pickled size plus 8 bytes."""
        if self.world_size == 1:
            return obj
        start = time.perf_counter()
        import pickle

        result = self.backend.broadcast_object(obj, src)
        n = len(pickle.dumps(result)) + 8
        sent, received = ((self.world_size - 1) * n, 0) if self.rank == src else (0, n)
        self.stats.add("broadcast_object", sent, received, time.perf_counter() - start)
        return result

    # -- all_gather ---------------------------------------------------------------------------
    def all_gather_async(self, tensor: Tensor, same_shape: bool = False) -> Future:
        """Gather from every rank, in rank order. Unequal first dimensions are allowed unless
        ``same_shape=True`` promises equal shapes (which skips the shape exchange)."""
        w = self.world_size
        if w == 1:
            return completed_future([tensor.clone()])
        if same_shape:
            n = _nbytes(tensor)
            return self._account("all_gather", (w - 1) * n, (w - 1) * n, self.backend.all_gather(tensor))
        shape = torch.tensor(list(tensor.shape), dtype=torch.int64)
        shapes_fut = self.backend.all_gather(self.backend._to_device(shape))
        self._account(
            "all_gather", (w - 1) * _nbytes(shape), (w - 1) * _nbytes(shape), completed_future(None)
        )
        shapes = [s.cpu() for s in shapes_fut.wait()]
        rest = tuple(tensor.shape[1:])
        for s in shapes:
            if tuple(s.tolist()[1:]) != rest:
                raise ValueError(
                    f"all_gather: tensors may differ only in their first dimension; got shapes "
                    f"{[tuple(x.tolist()) for x in shapes]}"
                )
        lengths = [int(s[0]) for s in shapes] if tensor.dim() > 0 else [1] * w
        longest = max(lengths)
        padded = tensor
        if tensor.dim() > 0 and tensor.shape[0] < longest:
            padded = torch.zeros((longest, *rest), dtype=tensor.dtype, device=tensor.device)
            padded[: tensor.shape[0]] = tensor
        n = _nbytes(padded)
        fut = self._account("all_gather", (w - 1) * n, (w - 1) * n, self.backend.all_gather(padded))
        if tensor.dim() == 0:
            return fut
        return fut.then(lambda f: [g[:length] for g, length in zip(f.value(), lengths)])

    def all_gather(self, tensor: Tensor, same_shape: bool = False) -> list[Tensor]:
        return self.all_gather_async(tensor, same_shape).wait()

    # -- reduce_scatter -----------------------------------------------------------------------
    def reduce_scatter_async(self, tensor: TensorOrList, op: str = "sum") -> Future:
        """Reduce over ranks and keep this rank's share: the r-th of W equal chunks along dim 0
        (or the r-th tensor of a list of W)."""
        op = check_reduce_op(op)
        if op == "adasum":
            raise ValueError("reduce_scatter: op='adasum' is not supported; accepted: sum, avg, min, max")
        w = self.world_size
        if isinstance(tensor, Tensor):
            if tensor.shape[0] % w != 0:
                raise ValueError(
                    f"reduce_scatter: first dimension {tensor.shape[0]} must divide by world size {w}"
                )
            inputs = list(tensor.chunk(w))
        else:
            inputs = list(tensor)
            if len(inputs) != w:
                raise ValueError(f"reduce_scatter: needs {w} input tensors (one per rank), got {len(inputs)}")
        if w == 1:
            return completed_future(inputs[0].clone())
        output = torch.empty_like(inputs[self.rank])
        inputs = [t.contiguous() for t in inputs]
        n = sum(_nbytes(t) for t in inputs)
        moved = (w - 1) * n // w
        return self._account("reduce_scatter", moved, moved, self.backend.reduce_scatter(output, inputs, op))

    def reduce_scatter(self, tensor: TensorOrList, op: str = "sum") -> Tensor:
        return self.reduce_scatter_async(tensor, op).wait()

    # -- all_to_all ---------------------------------------------------------------------------
    def all_to_all_async(self, inputs: Sequence[Tensor]) -> Future:
        """Send ``inputs[j]`` to rank j; returns what each rank sent here, in rank order.
        First dimensions may differ (shapes are exchanged first)."""
        w = self.world_size
        inputs = [t.contiguous() for t in inputs]
        if len(inputs) != w:
            raise ValueError(f"all_to_all: needs {w} input tensors (one per rank), got {len(inputs)}")
        if w == 1:
            return completed_future([inputs[0].clone()])
        lengths = torch.tensor([t.shape[0] if t.dim() else 1 for t in inputs], dtype=torch.int64)
        got = [torch.empty(1, dtype=torch.int64) for _ in range(w)]
        send_len = [self.backend._to_device(x.reshape(1)) for x in lengths]
        recv_len = [self.backend._to_device(x) for x in got]
        self.backend.all_to_all(recv_len, send_len).wait()
        self.count("all_to_all", (w - 1) * 8, (w - 1) * 8)
        ref = inputs[self.rank]
        rest = tuple(ref.shape[1:])
        outputs = [
            torch.empty((int(n.item()), *rest) if ref.dim() else (), dtype=ref.dtype, device=ref.device)
            for n in recv_len
        ]
        sent = sum(_nbytes(t) for j, t in enumerate(inputs) if j != self.rank)
        received = sum(_nbytes(t) for j, t in enumerate(outputs) if j != self.rank)
        return self._account("all_to_all", sent, received, self.backend.all_to_all(outputs, inputs))

    def all_to_all(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        return self.all_to_all_async(inputs).wait()

    # -- point to point and barrier ---------------------------------------------------------------
    def send(self, tensor: Tensor, dst: int) -> Future:
        return self._account("send", _nbytes(tensor), 0, self.backend.send(tensor, dst))

    def recv(self, tensor: Tensor, src: int) -> Future:
        return self._account("recv", 0, _nbytes(tensor), self.backend.recv(tensor, src))

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        start = time.perf_counter()
        self.backend.barrier()
        self.stats.add("barrier", 0, 0, time.perf_counter() - start)
