"""Top-k sparsification with error feedback: send the k largest-magnitude entries and their indices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.compression.base import (
    Compressor,
    Context,
    Key,
    Round,
    Rounds,
    Shape,
    all_finite,
    allgather_bytes,
    build_config,
    check_bool,
    flatten_fp32,
    keep_if,
    pack,
    packed_bytes,
    unflatten,
    unpack,
)


@dataclass
class TopKConfig:
    ratio: float = 0.01
    """Fraction of entries sent per bucket, in (0, 1]; k = ceil(ratio * numel)."""
    error_feedback: bool = True
    """Add what was not sent to the next step's gradient."""

    def __post_init__(self) -> None:
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(f"topk: ratio={r!r} must be in (0, 1]")
        check_bool("topk", "error_feedback", self.error_feedback)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def scatter_ranks(numel: int, indices: Tensor, values: Tensor) -> Tensor:
    """Sum rows of sparse (indices, values) [W, k] into a dense vector, rank by rank (deterministic)."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    for idx, val in zip(indices.long(), values, strict=True):
        out[idx] += val
    return out


class TopK(Compressor):
    """Each rank sends its k largest |gradient + residual| entries (fp32 value, int32 index)."""

    name = "topk"
    aggregation = "allgather"

    def __init__(self, config: Optional[TopKConfig] = None, **options: Any) -> None:
        super().__init__()
        self.config = build_config(self.name, TopKConfig, config, options)

    def k(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.config.ratio * numel)))

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        st = self._key_state(key, tensors)
        st["step"] += 1
        flat = flatten_fp32(tensors)
        n, k = flat.numel(), self.k(flat.numel())
        ef = self.config.error_feedback
        old = st.get("residual") if ef else None
        acc = flat + old if old is not None else flat
        _, idx = acc.abs().topk(k, sorted=False)
        values = acc[idx]
        specs = [(torch.float32, k), (index_dtype(n), k)]
        gathered = yield Round("allgather", pack([values, idx.to(specs[1][0])]))
        g_values, g_idx = unpack(gathered, specs)
        if ef:
            st["residual"] = keep_if(all_finite(g_values), acc.index_fill(0, idx, 0.0), old)
        dense = scatter_ranks(n, g_idx, g_values).div_(ctx.world_size)
        return unflatten(dense, tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        n = sum(math.prod(s) for s in shapes)
        k = self.k(n)
        return allgather_bytes(packed_bytes([(torch.float32, k), (index_dtype(n), k)]), world_size)
