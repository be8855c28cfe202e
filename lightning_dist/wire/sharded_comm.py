"""What ``Sharded`` puts into FSDP2's communication extension points.

``PackAllGather`` (FSDP2's ``set_custom_all_gather``): the parameter all-gather of one FSDP parameter
group, through the shard group's ``Communicator``, so the strategy's counters hold every byte.

``PackReduceScatter`` (FSDP2's ``set_custom_reduce_scatter``): the reduce-scatter of one FSDP
parameter group inside its shard group, through the shard group's ``Communicator`` (so its bytes are
counted with every other collective of the strategy): fp32 as FSDP2 sends it, bf16/fp16 (cast,
reduce-scatter, cast back) or int8 with per-block scales (``compression.reduce_scatter``: quantised
when posted, dequantised and summed where it lands, on the thread that waits for it, so the
transport's completion thread does no compression work).

``ReplicaSync`` (FSDP2's ``set_all_reduce_hook``, which FSDP2 calls with the reduce-scattered shard
gradient when the module is sharded over a 1-D mesh): the average of that shard over the replica
groups, through the replicate group's communicator and any compressor of the pack, or their
gradient-space Adasum (per parameter shard).

On CPU tensors the all-gather returns a ``Work`` that FSDP2 waits on in its copy-out, so its
backward prefetch (the next unit's all-gather posted before this unit's backward) overlaps compute;
the reduce-scatter and the replica sync after it land later where FSDP2 does not read their output
at once (``sharded_landing``: the strategy waits for them at the end of the backward), and wait
where it does. On CUDA both are issued on the stream FSDP2 makes current (its all-gather,
reduce-scatter and all-reduce streams) and return once posted there, stream-ordered as FSDP2's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import run_exchanges
from lightning_dist.collectives.work import FutureWork
from lightning_dist.compression import Compressor
from lightning_dist.compression.reduce_scatter import quantize_rows, sum_rows
from lightning_dist.wire.sharded_landing import Landing, PendingGradients, once

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _averages(op: Any) -> bool:
    """Whether FSDP2 asks for the average (``ReduceOp.AVG``) or the sum (``ReduceOp.SUM``, with its
    own pre/post division); anything else (a custom divide factor: ``PREMUL_SUM``) is refused."""
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1].upper()
    if name in ("AVG", "SUM"):
        return name == "AVG"
    raise ValueError(
        f"Sharded: FSDP2 asked for reduce op {op!r}; the pack's reduce-scatter accepts AVG and SUM only "
        "(do not call set_gradient_divide_factor on modules a Sharded strategy trains)"
    )


def _check_group(group: Any, comm: Communicator) -> None:
    if group.size() != comm.world_size:
        raise RuntimeError(
            f"Sharded: FSDP2 communicates over a group of {group.size()} ranks, the strategy's shard group "
            f"has {comm.world_size}; shard the model over trainer.strategy.device_mesh['shard']"
        )


class _PlainBuffers:
    """FSDP2's ``Comm.allocate``: plain ``torch.empty`` buffers (the caching allocator on CUDA)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class PackAllGather(_PlainBuffers, AllGather):
    """One FSDP parameter group's all-gather over ``comm`` (the shard group), as FSDP2 sends it: on
    CPU tensors a ``Work`` FSDP2 waits on in its copy-out, on CUDA posted on the current stream."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> Optional[FutureWork]:
        _check_group(group, self.comm)
        if output_tensor.is_cuda:
            self.comm.all_gather_into(output_tensor, input_tensor)
            return None
        fut = self.comm.all_gather_into_async(output_tensor, input_tensor)
        return self.comm.as_work(fut, "all_gather", f"FSDP all-gather, {input_tensor.numel()} elements")


@dataclass(eq=False)
class PackReduceScatter(_PlainBuffers, ReduceScatter):
    """One FSDP parameter group's reduce-scatter over ``comm`` (the shard group), ``compression``
    None (fp32), ``"bf16"``, ``"fp16"`` or ``"int8"``. Holds the group's error-feedback residual.

    With a ``landing`` it may return before the result is in place (``sharded_landing``): the
    landing's ``pending`` set completes it, or the group's all-reduce hook, through ``deferred``."""

    comm: Communicator
    compression: Optional[str] = None
    block_size: int = 1024
    error_feedback: bool = False
    residual: Optional[Tensor] = None
    """int8 with error feedback: what quantisation dropped from this rank's last input."""
    landing: Optional[Landing] = None
    deferred: Optional[Callable[[], None]] = None
    """The last call's landing (wait, then write the output), when it returned before that; else None."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        _check_group(group, self.comm)
        average = _averages(op)
        self.deferred = None
        land = self._post(output_tensor, input_tensor, average)
        landing = self.landing
        if landing is not None and landing.may_defer(output_tensor, average) and landing.pending.defer(land):
            self.deferred = land
            return
        land()

    def _post(self, output: Tensor, flat: Tensor, average: bool) -> Callable[[], None]:
        """Post the reduce-scatter of ``flat``; returns its landing (it runs once, however often it is
        called): wait for it, then write this rank's result into ``output``, on the calling thread
        (on CUDA, on its current stream)."""
        comm, w = self.comm, self.comm.world_size
        detail = f"FSDP reduce-scatter, {flat.numel()} elements"
        if self.compression == "int8":
            # quantised here, summed where it lands: the transport's completion thread only
            # receives, so it is free for the next collectives (and never waits for the GIL)
            payload, layout = quantize_rows(flat, w, self.block_size, self._residual(flat))
            rows = list(payload.unbind(0))  # row j to rank j, as ``start_round`` posts an all_to_all round
            sent = comm.all_to_all_async(rows, [rows[0].shape[0]] * w)

            def _int8_lands() -> None:
                output.copy_(sum_rows(comm.wait(sent, "all_to_all", detail), layout, average))

            return once(_int8_lands)
        wire = WIRE_DTYPES.get(self.compression or "")
        payload = flat if wire is None else flat.to(wire)
        if wire is not None and average:
            payload.div_(w)  # before the sum, in the wire dtype: as torch's fp16 hook, no overflow
        fut = comm.reduce_scatter_async(payload.view(w, -1), "sum")

        def _lands() -> None:
            output.copy_(comm.wait(fut, "reduce_scatter", detail).view(-1))
            if wire is None and average:
                output.div_(w)  # fp32: after the sum, as FSDP2's own AVG

        return once(_lands)

    def _residual(self, flat: Tensor) -> Optional[Tensor]:
        """The error-feedback residual for ``flat`` (zeros at first), or None without error feedback."""
        if not self.error_feedback:
            return None
        if self.residual is None or self.residual.shape != flat.shape:
            self.residual = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        self.residual = self.residual.to(flat.device)
        return self.residual


@dataclass(eq=False)
class ReplicaSync:
    """FSDP2's all-reduce hook for one FSDP parameter group: average its reduce-scattered shard
    gradient over the replica groups through ``comm`` (the replicate group) and ``compressor``
    (state under ``key``), or (``adasum``) combine the replicas' shards by gradient-space Adasum,
    per parameter shard.

    ``shards``: (offset, shape) of each parameter's shard in the flat shard gradient (FSDP2 pads
    each to equal size per rank); per-tensor compressors and Adasum see those tensors, the others
    the flat gradient, padding included (zeros on every rank)."""

    comm: Communicator
    compressor: Compressor
    key: str
    shards: list[tuple[int, torch.Size]]
    adasum: bool = False
    reduce_scatter: Optional[PackReduceScatter] = None
    """This group's reduce-scatter: a result it left in flight is waited for before it is read."""
    pending: Optional[PendingGradients] = None
    """Where the sync itself is left in flight, when its reduce-scatter was (the same conditions)."""

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [flat[o : o + s.numel()].view(s) for o, s in self.shards if s.numel() > 0]

    def __call__(self, reduce_output: Tensor) -> None:
        comm, compressor = self.comm, self.compressor
        w, rank = comm.world_size, comm.rank
        deferred = None if self.reduce_scatter is None else self.reduce_scatter.deferred
        if deferred is not None:
            deferred()  # the shard gradient lands before its replicas' sync reads it
        if w == 1:
            return
        if self.adasum:
            views = self._views(reduce_output)
            group = [
                compressor.exchange(f"{self.key}.{j}", v, world_size=w, rank=rank, adasum=True)
                for j, v in enumerate(views)
            ]
            run_exchanges(comm, [group]).wait()
            for v, ex in zip(views, group, strict=True):
                v.copy_(ex.result[0])  # type: ignore[index]
            return
        views = self._views(reduce_output) if compressor.per_tensor else [reduce_output]
        ex = compressor.exchange(self.key, views, world_size=w, rank=rank)

        def _copy_back() -> None:
            assert ex.result is not None
            for v, r in zip(views, ex.result, strict=True):
                if r.data_ptr() != v.data_ptr():
                    v.copy_(r)

        pending = self.pending
        if deferred is None or pending is None:
            run_exchanges(comm, [[ex]]).wait()
            _copy_back()
            return
        # behind the replica sync before it: their later rounds are posted from completion callbacks
        done = run_exchanges(comm, [[ex]], after=pending.replica_tail)
        pending.replica_tail = done
        detail = f"replica sync of {self.key}, {reduce_output.numel()} elements"

        def _lands() -> None:
            comm.wait(done, "replica_sync", detail)
            _copy_back()

        if not pending.defer(_lands):
            _lands()
