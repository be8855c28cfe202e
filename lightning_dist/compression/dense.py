"""Dense all-reduce compressors: ``none`` (DDP's own average) and the fp16/bf16 casts.

Each rank casts its flat gradient to the wire dtype, divides it by W there (not for Adasum, which
combines rather than sums; the order of torch's fp16 hook, and half the bytes to divide) and
all-reduces it; the result comes back in the gradients' own dtypes, cast once per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.compression.packing import flatten_fp32, flatten_native, unflatten
from lightning_dist.compression.protocol import Compressor, Context, Key, Round, Rounds
from lightning_dist.compression.wire import Shape, ring_all_reduce_bytes, total_numel


class DenseAllReduce(Compressor):
    """All-reduce every entry in ``wire_dtype`` (None: the gradients' own dtype, uncompressed)."""

    wire_dtype: ClassVar[Optional[torch.dtype]] = None
    aggregation = "allreduce"
    supports_adasum = True

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        wire = self.wire_dtype
        flat = flatten_native(tensors) if wire is None else flatten_fp32(tensors)
        if ctx.adasum:
            payload = flat.to(wire or flat.dtype, copy=True)
        elif wire is None:
            payload = flat / ctx.world_size
        else:
            payload = flat.to(wire).div_(ctx.world_size)
        reduced = yield Round("allreduce", payload, "adasum" if ctx.adasum else "sum")
        return unflatten(reduced, tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        return ring_all_reduce_bytes(total_numel(shapes) * (self.wire_dtype or dtype).itemsize, world_size)


class NoCompression(DenseAllReduce):
    """The reference: bitwise what DDP's default hook computes."""

    name = "none"


class FP16Compression(DenseAllReduce):
    """Cast to float16 (range +-65504: larger gradients overflow to inf, as in torch's fp16 hook)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compression(DenseAllReduce):
    """Cast to bfloat16 (fp32's range, 8 bits of mantissa)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
