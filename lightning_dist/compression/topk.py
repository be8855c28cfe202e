"""Top-k sparsification with error feedback: send the k largest-magnitude entries and their indices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_number
from lightning_dist.compression.packing import flatten_fp32, keep_if, unflatten
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds
from lightning_dist.compression.sparse import gather_sparse, gather_sparse_bytes
from lightning_dist.compression.wire import Shape, total_numel


@dataclass
class TopKConfig:
    """Options of ``TopK``."""

    ratio: float = 0.01
    """Fraction of entries sent per bucket, in (0, 1]; k = ceil(ratio * numel)."""
    error_feedback: bool = True
    """Add what was not sent to the next step's gradient."""

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, 0, 1, low_open=True, owner="topk")
        check_bool("error_feedback", self.error_feedback, owner="topk")


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype for a vector of ``numel`` entries."""
    return torch.int32 if numel < 2**31 else torch.int64


class TopK(Compressor):
    """Each rank sends its k largest |gradient + residual| entries (fp32 value, int32 index)."""

    name = "topk"
    config_class = TopKConfig
    config: TopKConfig
    aggregation = "allgather"

    def k(self, numel: int) -> int:
        """Entries sent from a bucket of ``numel``."""
        return max(1, min(numel, math.ceil(self.config.ratio * numel)))

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        st, _ = self._begin_step(key, tensors)
        flat = flatten_fp32(tensors)
        n, k = flat.numel(), self.k(flat.numel())
        ef = self.config.error_feedback
        old = st.get("residual") if ef else None
        acc = flat + old if old is not None else flat
        _, idx = acc.abs().topk(k, sorted=False)
        dense, ok = yield from gather_sparse(n, acc[idx], idx.to(index_dtype(n)))
        if ef:
            st["residual"] = keep_if(ok, acc.index_fill(0, idx, 0.0), old)
        return unflatten(dense.div_(ctx.world_size), tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        n = total_numel(shapes)
        return gather_sparse_bytes(self.k(n), index_dtype(n), world_size)
