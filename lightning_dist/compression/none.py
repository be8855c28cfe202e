"""No compression: DDP's own all-reduce (divide by W, then sum), in the gradients' dtype."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

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
    flatten_native,
    ring_allreduce_bytes,
    unflatten,
)


class NoCompression(Compressor):
    """The reference: bitwise what DDP's default hook computes."""

    name = "none"
    aggregation = "allreduce"
    supports_adasum = True

    def __init__(self, config: Optional[NoOptions] = None, **options: Any) -> None:
        super().__init__()
        self.config = build_config(self.name, NoOptions, config, options)

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        flat = flatten_native(tensors)
        payload = flat.clone() if ctx.adasum else flat / ctx.world_size
        reduced = yield Round("allreduce", payload, "adasum" if ctx.adasum else "sum")
        return unflatten(reduced, tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        n = sum(math.prod(s) for s in shapes)
        return ring_allreduce_bytes(n * torch.empty((), dtype=dtype).element_size(), world_size)
