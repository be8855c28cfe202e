"""Transport over a torch.distributed process group (Gloo on CPU tensors, NCCL on CUDA tensors).

Calls go to the ``ProcessGroup`` object's methods, so a group made without ``init_process_group``
(one per thread in tests) works the same as the default world group.

Every operation returns the work's own future where torch gives one. Gloo gives none for send, recv
and reduce_scatter, so reduce_scatter runs as an ``alltoall_base`` plus a local reduction, and
send/recv are completed by one ``Completer`` thread per backend.

A large Gloo all-gather goes out in pieces of at most ``TorchBackend.gloo_piece_bytes``, all issued
at once (Gloo's worker threads keep two in flight). Over a rate-limited full-duplex link one
multi-megabyte all-gather lets each rank queue its whole payload at once, and at random one direction
then stalls for about 100 ms (most likely its ACKs queue behind the other direction's data). Measured on
2 emulated nodes at 100 Mbit/s (3.15 MB of int8 per rank in one all-gather): the slower rank took
310-370 ms in half the calls, 224-234 ms in the others; in 512 KiB pieces, 224-254 ms every time.
Compressed("int8")'s step on the 4.2M-parameter MLP there: median 399-427 ms whole, 350-354 ms in
1 MiB pieces. Pieces cost a few ms per step on an uncapped link, hence 1 MiB rather than smaller.
``all_gather_into`` (FSDP2's parameter all-gather) of CPU tensors of at most one piece goes straight
into its output (``_allgather_base``, as FSDP2's own on Gloo): no per-rank buffers, copies or extra
completion callback, about 1 ms less per call at 4 ranks on 2 cores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives.backend import Backend, cat_rows, group_ranks, rows, split_rows
from lightning_dist.collectives.completer import Completer

logger = logging.getLogger(__name__)

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _first(fut: Future) -> Any:
    value = fut.value()
    return value[0] if isinstance(value, list) else value


def _then(work: Any, result: Callable[[], Any]) -> Future:
    """``work``'s future, completed with ``result()``; the work's own error, if any, fails it
    instead (a callback that never reads its future's value would drop that error: a timed-out
    all_gather would deliver uninitialised buffers)."""

    def _done(fut: Future) -> Any:
        fut.value()  # raises the work's error
        return result()

    return work.get_future().then(_done)


def _all_then(works: list[Any], result: Callable[[], Any]) -> Future:
    """One future for several works: completed with ``result()`` once all are done, or failed
    with the first error among them."""
    futures = [w.get_future() for w in works]

    def _done(_: Future) -> Any:
        for fut in futures:
            fut.value()  # raises a piece's error
        return result()

    return torch.futures.collect_all(futures).then(_done)


def piece_bounds(numel: int, element_size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of at most ``piece_bytes`` (at least one element) covering ``numel``."""
    step = max(1, piece_bytes // element_size)
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


def group_timeout_s(group: Any, device_type: str = "cpu") -> Optional[float]:
    """The timeout ``group`` was made with, in seconds (``init_process_group(timeout=...)``, a
    ``ProcessGroupGloo(store, rank, size, timeout)``), or ``None`` where torch does not tell.

    torch keeps it in the backend object's ``options._timeout``: a ``ProcessGroupGloo`` or
    ``ProcessGroupNCCL`` has ``options``; a ``ProcessGroup`` (what ``init_process_group`` makes)
    reaches its backend for a device through ``_get_backend``.
    """
    candidates = [group]
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is not None:
        for device in dict.fromkeys((device_type, "cpu", "cuda")):
            try:
                candidates.append(get_backend(torch.device(device)))
            except (RuntimeError, ValueError, TypeError):
                continue  # no backend for that device type
    for candidate in candidates:
        try:
            options = getattr(candidate, "options", None)
            timeout = getattr(options, "_timeout", None) or getattr(options, "timeout", None)
        except RuntimeError:
            continue
        if isinstance(timeout, timedelta):
            return timeout.total_seconds()
    return None


def _reduce_into(output: Tensor, parts: list[Tensor], op: str) -> Tensor:
    """``output`` = ``parts[0]`` op ``parts[1]`` op ... in that (rank) order."""
    output.copy_(parts[0].view_as(output))
    for part in parts[1:]:
        part = part.view_as(output)
        if op == "sum":
            output.add_(part)
        elif op == "min":
            torch.minimum(output, part, out=output)
        else:
            torch.maximum(output, part, out=output)
    return output


class TorchBackend(Backend):
    """Collectives on one ``torch.distributed`` process group."""

    name = "torch"
    gloo_piece_bytes: int = 1 << 20
    """Largest piece of a Gloo (CPU) all-gather; larger payloads go out in pieces (module docstring)."""

    def __init__(self, group: Optional[Any] = None) -> None:
        """``group``: a ``ProcessGroup`` (default: the world group) or a backend object such as
        ``ProcessGroupGloo`` made directly from a store."""
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "TorchBackend(group=None) uses torch.distributed's default process group, and none is "
                    "initialised in this process. Run it under a pack strategy, which initialises one on "
                    "every rank (L.Trainer(strategy=DDP()), Compressed(...), Elastic(...), DiLoCo(...)); or "
                    "call torch.distributed.init_process_group(backend='gloo' or 'nccl', ...) first (under "
                    "torchrun the environment supplies rank and world size); or pass group= (a "
                    "ProcessGroup or a backend such as ProcessGroupGloo built from a store). In one process "
                    "with no peers, SingleProcessBackend() is the world-size-1 twin"
                )
            group = dist.group.WORLD
        assert group is not None
        self.group: Any = group
        self.transport = self._detect_transport()
        """The process group's backend (``gloo``, ``nccl``): named by a ``CollectiveTimeout``."""
        self._device_type = "cuda" if "nccl" in self.transport else "cpu"
        self.timeout_s: Optional[float] = group_timeout_s(group, self._device_type)
        """The group's configured timeout in seconds, named by a ``CollectiveTimeout``; read from
        the group (torch keeps it in the backend's options), ``None`` where torch does not tell."""
        self._completers: dict[int, Completer] = {}  # per p2p tag: one tag's waits never hold up another's
        logger.debug(
            "TorchBackend: rank %d of %d on %s (%s, timeout %s s)",
            group.rank(),
            group.size(),
            self._device_type,
            self.transport,
            self.timeout_s,
        )

    @property
    @override
    def rank(self) -> int:
        return self.group.rank()

    @property
    @override
    def world_size(self) -> int:
        return self.group.size()

    @property
    @override
    def device_type(self) -> str:
        return self._device_type

    @override
    def spans(self, group: Any) -> bool:
        if group is None or group is self.group:
            return True
        ranks = group_ranks(group)
        return ranks is not None and ranks == group_ranks(self.group)

    def _detect_transport(self) -> str:
        name: str
        try:
            name = str(dist.get_backend(self.group))
        except (RuntimeError, ValueError):
            name = str(self.group.name()) if hasattr(self.group, "name") else "gloo"
        return name.lower()

    @override
    def all_reduce(self, tensor: Tensor, op: str, name: Optional[str] = None) -> Future:
        opts = dist.AllreduceOptions()
        if op == "avg":
            # Divide first, then sum: the order torch's DDP reducer uses, so results match it bitwise.
            tensor.div_(self.world_size)
            opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        else:
            opts.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
        return self.group.allreduce([tensor], opts).get_future().then(_first)

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.group.broadcast([tensor], opts).get_future().then(_first)

    @override
    def all_gather(self, tensor: Tensor) -> Future:
        outputs = [
            torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(self.world_size)
        ]
        if self.device_type == "cuda" or tensor.numel() * tensor.element_size() <= self.gloo_piece_bytes:
            work = self.group.allgather([outputs], [tensor])
            return _then(work, lambda: outputs)
        flat = tensor.reshape(-1)
        flat_outputs = [out.view(-1) for out in outputs]
        works = [
            self.group.allgather([[out[s:e] for out in flat_outputs]], [flat[s:e]])
            for s, e in piece_bounds(flat.numel(), tensor.element_size(), self.gloo_piece_bytes)
        ]
        return _all_then(works, lambda: outputs)

    @override
    def all_gather_into(self, output: Tensor, tensor: Tensor) -> Future:
        small = tensor.numel() * tensor.element_size() <= self.gloo_piece_bytes
        straight = small and not tensor.is_cuda and tensor.is_contiguous() and output.is_contiguous()
        if self.device_type != "cuda" and not straight:
            # Gloo: in pieces (module docstring); CUDA tensors as before (Gloo's _allgather_base on
            # them has not run here)
            return super().all_gather_into(output, tensor)
        work = self.group._allgather_base(output, tensor)  # straight into output: no copy
        return _then(work, lambda: output)

    @override
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        if op == "avg":
            # Divide first, then sum, as in all_reduce.
            inputs = [t / self.world_size for t in inputs]
            op = "sum"
        if self.device_type == "cuda":
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
            work = self.group.reduce_scatter([output], [inputs], opts)
            return _then(work, lambda: output)
        # Gloo: chunk j goes to rank j, which reduces the W chunks it receives in rank order; this
        # sends the (W - 1) N / W bytes of a ring reduce-scatter.
        w = self.world_size  # callbacks must not hold the backend (see Communicator._timed)
        send = torch.cat([t.reshape(-1) for t in inputs])
        recv = send.new_empty(w * output.numel())
        work = self.group.alltoall_base(
            recv, send, [output.numel()] * w, [t.numel() for t in inputs], dist.AllToAllOptions()
        )
        return _then(work, lambda: _reduce_into(output, list(recv.chunk(w)), op))

    @override
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        # alltoall_base with split sizes handles unequal first dimensions on Gloo and NCCL alike.
        send = cat_rows(inputs)
        recv = send.new_empty((sum(rows(t) for t in outputs), send.shape[1]))
        work = self.group.alltoall_base(
            recv, send, [rows(t) for t in outputs], [rows(t) for t in inputs], dist.AllToAllOptions()
        )
        return _then(work, lambda: split_rows(recv, outputs))

    @property
    @override
    def independent_tags(self) -> bool:
        return self.device_type == "cpu"

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        return self._p2p_future(self.group.send([tensor], dst, tag), tensor, tag)

    @override
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        return self._p2p_future(self.group.recv([tensor], src, tag), tensor, tag)

    def _p2p_future(self, work: Any, tensor: Tensor, tag: int) -> Future:
        if self.device_type == "cuda":
            return _then(work, lambda: tensor)
        completer = self._completers.get(tag)
        if completer is None:
            completer = self._completers[tag] = Completer(f"torch-p2p-rank{self.rank}-tag{tag}")
        return completer.submit(work.wait, lambda _: tensor)

    @override
    def close(self) -> None:
        for completer in list(self._completers.values()):
            completer.stop()

    @override
    def barrier(self) -> None:
        if self.device_type == "cuda":
            # A tiny all-reduce instead of ProcessGroup.barrier, which guesses a device for NCCL.
            self.all_reduce(self.to_transport_device(torch.zeros(1)), "sum").wait()
        else:
            self.group.barrier().wait()
