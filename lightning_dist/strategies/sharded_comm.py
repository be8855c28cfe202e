"""What ``Sharded`` puts into FSDP2's communication extension points.

``PackAllGather`` (FSDP2's ``set_custom_all_gather``): the parameter all-gather of one FSDP parameter
group, through the shard group's ``Communicator``, so the strategy's counters hold every byte.

``PackReduceScatter`` (FSDP2's ``set_custom_reduce_scatter``): the reduce-scatter of one FSDP
parameter group inside its shard group, through the shard group's ``Communicator`` (so its bytes are
counted with every other collective of the strategy): fp32 as FSDP2 sends it, bf16/fp16 (cast,
reduce-scatter, cast back) or int8 with per-block scales (``compression.reduce_scatter``).

``ReplicaSync`` (FSDP2's ``set_all_reduce_hook``, which FSDP2 calls with the reduce-scattered shard
gradient when the module is sharded over a 1-D mesh): the average of that shard over the replica
groups, through the replicate group's communicator and any compressor of the pack, or their
gradient-space Adasum (per parameter shard).

FSDP2 calls them synchronously (on CUDA, on its reduce-scatter / all-reduce streams, which every
operation here is issued on); neither returns before its result is in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import run_exchanges
from lightning_dist.compression import Compressor, Exchange
from lightning_dist.compression.reduce_scatter import int8_reduce_scatter

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
    """One FSDP parameter group's all-gather over ``comm`` (the shard group), as FSDP2 sends it."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> None:
        _check_group(group, self.comm)
        self.comm.all_gather_into(output_tensor, input_tensor)


@dataclass(eq=False)
class PackReduceScatter(_PlainBuffers, ReduceScatter):
    """One FSDP parameter group's reduce-scatter over ``comm`` (the shard group), ``compression``
    None (fp32), ``"bf16"``, ``"fp16"`` or ``"int8"``. Holds the group's error-feedback residual."""

    comm: Communicator
    compression: Optional[str] = None
    block_size: int = 1024
    error_feedback: bool = False
    residual: Optional[Tensor] = None
    """int8 with error feedback: what quantisation dropped from this rank's last input."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> None:
        comm, w = self.comm, self.comm.world_size
        _check_group(group, comm)
        average = _averages(op)
        if self.compression == "int8":
            output_tensor.copy_(self._int8(input_tensor, average))
            return
        wire = WIRE_DTYPES.get(self.compression or "")
        if wire is None:
            reduced = comm.reduce_scatter(input_tensor.view(w, -1), "sum")
            output_tensor.copy_(reduced.view(-1))
            if average:
                output_tensor.div_(w)
            return
        payload = input_tensor.to(wire)
        if average:
            payload.div_(w)  # before the sum, in the wire dtype: as torch's fp16 hook, no overflow
        output_tensor.copy_(comm.reduce_scatter(payload.view(w, -1), "sum").view(-1))

    def _int8(self, flat: Tensor, average: bool) -> Tensor:
        residual = None
        if self.error_feedback:
            if self.residual is None or self.residual.shape != flat.shape:
                self.residual = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
            residual = self.residual = self.residual.to(flat.device)
        rounds = int8_reduce_scatter(
            flat, self.comm.world_size, self.block_size, average=average, residual=residual
        )
        ex = Exchange(rounds, self.comm.world_size)
        run_exchanges(self.comm, [[ex]]).wait()
        assert ex.result is not None
        return ex.result[0]


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

    def _views(self, flat: Tensor) -> list[Tensor]:
        return [flat[o : o + s.numel()].view(s) for o, s in self.shards if s.numel() > 0]

    def __call__(self, reduce_output: Tensor) -> None:
        comm, compressor = self.comm, self.compressor
        w, rank = comm.world_size, comm.rank
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
        run_exchanges(comm, [[ex]]).wait()
        assert ex.result is not None
        for v, r in zip(views, ex.result, strict=True):
            if r.data_ptr() != v.data_ptr():
                v.copy_(r)
