"""fp16 and bf16 casts: all-reduce a half-width copy (divided by W first), return the input dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.compression.base import (
    Compressor,
    Context,
    Key,
    NoOptions,
    Round,
    Rounds,
    Shape,
    build_config,
    flatten_fp32,
    ring_allreduce_bytes,
    unflatten,
)


class _Cast(Compressor):
    wire_dtype: ClassVar[torch.dtype]
    aggregation = "allreduce"
    supports_adasum = True

    def __init__(self, config: Optional[NoOptions] = None, **options: Any) -> None:
        super().__init__()
        self.config = build_config(self.name, NoOptions, config, options)

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        flat = flatten_fp32(tensors)
        payload = (flat if ctx.adasum else flat / ctx.world_size).to(self.wire_dtype)
        reduced = yield Round("allreduce", payload, "adasum" if ctx.adasum else "sum")
        return unflatten(reduced.float(), tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        n = sum(math.prod(s) for s in shapes)
        return ring_allreduce_bytes(2 * n, world_size)


class FP16Compression(_Cast):
    """Cast to float16 (range +-65504: larger gradients overflow to inf, as in torch's fp16 hook)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compression(_Cast):
    """Cast to bfloat16 (fp32's range, 8 bits of mantissa)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
