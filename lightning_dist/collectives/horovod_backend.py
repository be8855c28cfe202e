"""Transport over Horovod (``horovod.torch``): its fused collectives and its MPI Adasum.

Horovod is imported when a ``HorovodBackend`` is made, not when this module is, so the package works
without it. Horovod's ops are asynchronous handles; one ``Completer`` thread per backend waits on
them in order (``hvd.synchronize``) and completes a ``torch.futures.Future`` for each, so callers get
the same future-based interface as every other backend.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Optional

import torch
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives.accounting import ring_all_reduce_bytes
from lightning_dist.collectives.backend import Backend, cat_rows, rows, split_rows
from lightning_dist.collectives.completer import Completer

INSTALL_HINT = (
    "run `lightning-dist install-horovod` (from a checkout: scripts/install-horovod.sh) to build "
    "horovod 0.28.1 against the installed torch (`pip install horovod` fails on torch >= 2.1); the "
    "build needs a C++ compiler and cmake, plus MPI for Adasum (HorovodAdasum needs Horovod's MPI "
    "controller; --without-mpi builds with Gloo only)"
)

_ADASUM_DTYPES = (torch.float16, torch.float32, torch.float64)

BF16_GATHER_MAX_WORLD = 4
"""Up to this world size a bfloat16 all-reduce is an all-gather of its 16-bit words, which sends
(W - 1) N bytes, no more than the 4 (W - 1) N / W of a float32 ring all-reduce."""

logger = logging.getLogger(__name__)


def import_horovod() -> ModuleType:
    """``horovod.torch``, or an ImportError that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ImportError(f"horovod.torch is not importable ({exc}); {INSTALL_HINT}") from exc
    return hvd


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _hvd_query(name: str, doc: str) -> Any:
    """A read-only property returning ``self.hvd.<name>()``."""
    return property(lambda self: getattr(self.hvd, name)(), doc=doc)


class HorovodBackend(Backend):
    """Collectives over Horovod's global process set (launched by horovodrun, mpirun or srun).

    ``compression`` is reserved for Horovod's wire compression and is not applied yet.
    """

    name = "horovod"

    def __init__(self, compression: Optional[Any] = None, init: bool = True) -> None:
        self.hvd = import_horovod()
        if init and not self.hvd.is_initialized():
            self.hvd.init()
        self.compression = compression
        self._ops = {
            "sum": self.hvd.Sum,
            "avg": self.hvd.Average,
            "min": self.hvd.Min,
            "max": self.hvd.Max,
        }
        self._completer = Completer("horovod-completer")
        logger.debug("HorovodBackend: rank %d of %d", self.hvd.rank(), self.hvd.size())

    rank = _hvd_query("rank", "This process's rank among all.")
    world_size = _hvd_query("size", "Processes in all.")
    local_rank = _hvd_query("local_rank", "This process's rank on its node.")
    local_size = _hvd_query("local_size", "Processes on this node.")
    node_rank = _hvd_query("cross_rank", "This node's rank among the nodes.")

    @contextlib.contextmanager
    def completions_held(self) -> Iterator[None]:
        """Operations posted in the block complete once it ends (at most ``HOLD_MAX_S`` later), not
        while it runs: Horovod's wait polls and retakes the GIL in a loop, so waiting beside the
        caller's computation slows it (``Completer.hold``). The Horovod strategy holds them during
        backward, as Horovod's own optimizer only waits after it."""
        self._completer.hold()
        try:
            yield
        finally:
            self._completer.release()

    def _submit(self, handle: int, finish: Callable[[Any], Any]) -> Future:
        hvd = self.hvd  # the completer must not hold the backend
        return self._completer.submit(lambda: hvd.synchronize(handle), finish)

    def _op(self, op: str) -> Any:
        if op not in self._ops:
            raise ValueError(
                f"HorovodBackend: op={op!r} is not an elementwise reduction; accepted: sum, avg, min, max "
                "(Adasum goes through Communicator.all_reduce(..., op='adasum'))"
            )
        return self._ops[op]

    def _in_place(self, tensor: Tensor, start: Callable[[Tensor], int]) -> Future:
        """Run Horovod's in-place op ``start`` on ``tensor`` (through a contiguous copy if need be)."""
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        handle = start(work)
        return self._submit(handle, lambda _: tensor if work is tensor else tensor.copy_(work))

    @override
    def all_reduce(self, tensor: Tensor, op: str, name: Optional[str] = None) -> Future:
        """Horovod's all-reduce (``name`` lets Horovod's response cache skip the negotiation of a
        tensor it has seen: unnamed ops get a new name each call). Horovod 0.28 cannot reduce bfloat16: up to
        ``BF16_GATHER_MAX_WORLD`` ranks a bf16 tensor is all-gathered as int16 words and reduced in
        float32 in rank order (every rank gets the same result); beyond, it is reduced as float32.
        Either way the result is cast back into ``tensor``."""
        hvd_op = self._op(op)
        if tensor.dtype != torch.bfloat16:
            return self._in_place(tensor, lambda work: self.hvd.allreduce_async_(work, op=hvd_op, name=name))
        w = self.world_size
        if w > BF16_GATHER_MAX_WORLD:
            wide = tensor.float().contiguous()
            handle = self.hvd.allreduce_async_(wide, op=hvd_op, name=name)
            return self._submit(handle, lambda _: tensor.copy_(wide))
        shape = tensor.shape

        def _reduce(words: Tensor) -> Tensor:
            parts = words.view(torch.bfloat16).reshape(w, *shape).float()
            if op in ("sum", "avg"):
                total = parts.sum(0)
                total = total / w if op == "avg" else total
            else:
                total = parts.amin(0) if op == "min" else parts.amax(0)
            return tensor.copy_(total.to(torch.bfloat16))

        return self._submit(self._gather(tensor.reshape(-1).contiguous().view(torch.int16)), _reduce)

    @override
    def all_reduce_bytes(self, nbytes: int, dtype: torch.dtype) -> int:
        if dtype != torch.bfloat16:
            return super().all_reduce_bytes(nbytes, dtype)
        if self.world_size > BF16_GATHER_MAX_WORLD:
            return ring_all_reduce_bytes(2 * nbytes, self.world_size)  # float32 on the wire
        return (self.world_size - 1) * nbytes

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        return self._in_place(tensor, lambda work: self.hvd.broadcast_async_(work, root_rank=src))

    @override
    def broadcast_object(self, obj: Any, src: int) -> Any:
        # Horovod names the broadcast after type(obj) by default: a source passing a list and the
        # other ranks passing None would post differently named ops and hang. One fixed name works
        # because object broadcasts run one at a time.
        return self.hvd.broadcast_object(obj, root_rank=src, name="lightning_dist.broadcast_object")

    def _gather(self, work: Tensor) -> int:
        """Start Horovod's all-gather of a contiguous tensor (rank order along dim 0)."""
        with torch.inference_mode(False):  # Horovod resizes its output in its own thread
            return self.hvd.allgather_async(work)

    @override
    def all_gather(self, tensor: Tensor) -> Future:
        """Equal shapes in, list in rank order out (``Communicator`` pads unequal first dims)."""
        shape = tensor.shape
        w = self.world_size
        handle = self._gather(tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous())
        return self._submit(handle, lambda out: list(out.reshape(w, *shape).unbind(0)))

    @override
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        stacked = torch.stack([t.contiguous() for t in inputs])
        if op in ("sum", "avg"):
            with torch.inference_mode(False):  # output allocated and resized by Horovod's thread
                handle = self.hvd.reducescatter_async(stacked, op=self._op(op))
            return self._submit(handle, lambda out: output.copy_(out[0]))
        rank = self.rank
        handle = self.hvd.allreduce_async_(stacked, op=self._op(op))
        return self._submit(handle, lambda out: output.copy_(out[rank]))

    @override
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        splits = torch.tensor([rows(t) for t in inputs], dtype=torch.int32)
        with torch.inference_mode(False):  # output allocated and resized by Horovod's thread
            handle = self.hvd.alltoall_async(cat_rows(inputs), splits=splits)
        # alltoall_async's result is (received, received splits)
        return self._submit(
            handle, lambda result: split_rows(result[0] if isinstance(result, tuple) else result, outputs)
        )

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        raise NotImplementedError(
            "HorovodBackend has no point-to-point send; use TorchBackend (torch.distributed) for send/recv"
        )

    @override
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        raise NotImplementedError(
            "HorovodBackend has no point-to-point recv; use TorchBackend (torch.distributed) for send/recv"
        )

    @override
    def barrier(self) -> None:
        self.hvd.barrier()

    @override
    def close(self) -> None:
        self._completer.stop()

    # -- Adasum -------------------------------------------------------------------------------------
    @override
    def check_all_reduce(self, op: str, device_type: str) -> None:
        if op == "adasum":
            self.check_adasum(device_type)

    def check_adasum(self, device: str = "cpu") -> None:
        """Raise, on every rank, if Horovod cannot run Adasum in this job (call before training)."""
        hvd = self.hvd
        alternative = "lightning_dist's own Adasum works there: DDP(reduce_op='adasum') or a TorchBackend"
        if not hvd.mpi_built():
            raise RuntimeError(
                f"Horovod's Adasum needs MPI, and this horovod was built without it; {INSTALL_HINT} "
                f"with OpenMPI installed, or use {alternative}"
            )
        if not hvd.mpi_enabled():
            raise RuntimeError(
                "Horovod's Adasum needs the MPI controller, but this job runs Horovod over Gloo; "
                f"launch with `horovodrun --mpi` or `mpirun`, or use {alternative}"
            )
        size = hvd.size()
        if device != "cpu" and hvd.nccl_built():
            nodes = size // max(1, hvd.local_size())
            if not _is_pow2(nodes):
                raise ValueError(
                    f"Horovod's GPU Adasum needs a power-of-two number of nodes; got {nodes}; "
                    f"use {alternative}"
                )
        elif not _is_pow2(size):
            raise ValueError(
                f"Horovod's Adasum needs a power-of-two world size; got {size}; use {alternative}"
            )

    @override
    def native_adasum(self, tensors: list[Tensor]) -> Optional[tuple[int, int]]:
        """Horovod's MPI Adasum on each tensor, in place (bf16 goes through float32).

        Bytes are those of the VHDD model (2 N (W - 1) / W each way; the float64 norm sums omitted).
        """
        if not tensors:
            return 0, 0
        self.check_adasum(tensors[0].device.type)
        hvd = self.hvd
        handles = []
        for i, t in enumerate(tensors):
            if t.dtype in _ADASUM_DTYPES:
                work = t.detach() if t.is_contiguous() else t.detach().contiguous()
            elif t.dtype == torch.bfloat16:
                work = t.detach().float()
            else:
                raise ValueError(
                    f"op='adasum': tensor {i} has dtype {t.dtype}; accepted: float16, bfloat16, float32, float64"
                )
            # named, so Horovod's response cache recognises the same tensors at every step
            handles.append(
                (t, work, hvd.allreduce_async_(work, op=hvd.Adasum, name=f"lightning_dist.adasum.{i}"))
            )
        nbytes = 0
        for t, work, handle in handles:
            hvd.synchronize(handle)
            if work.data_ptr() != t.data_ptr():
                with torch.no_grad():
                    t.copy_(work)
            nbytes += work.numel() * work.element_size()
        moved = ring_all_reduce_bytes(nbytes, self.world_size)
        return moved, moved
