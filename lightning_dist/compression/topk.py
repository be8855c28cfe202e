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


SAMPLED_MIN_NUMEL = 1 << 16
"""Vectors of at least this many entries pick their top k (on CPU) through a sampled threshold."""


def largest_magnitudes(
    x: Tensor, k: int, *, stride: int = 97, margin: float = 1.5, min_numel: int = SAMPLED_MIN_NUMEL
) -> Tensor:
    """Indices (int64, in no particular order) of the k largest |x| of a flat vector, as
    ``x.abs().topk(k).indices`` (nan counts as largest; which of tied entries is unspecified).

    A full ``topk`` over millions of entries costs tens of ms on CPU, so there the k-th largest is
    estimated from every ``stride``-th entry (an odd prime: no alignment with matrix rows), lowered
    to keep about ``margin`` * k candidates, and ``topk`` runs over the candidates alone. When fewer
    than k pass the threshold (a sample that misjudged it), it falls back to the full ``topk``; when
    at least k do, they hold every one of the k largest, so the answer is exact either way."""
    n = x.numel()
    a = x.abs()
    samples = -(-n // stride)
    want = math.ceil(margin * k * samples / n)
    if x.device.type != "cpu" or n < min_numel or 2 * want > samples:
        return a.topk(k, sorted=False).indices
    thr = a[::stride].topk(want, sorted=False).values.min()
    candidates = (a < thr).logical_not_().nonzero().view(-1)  # |x| >= thr, and nan
    if candidates.numel() < k:
        return a.topk(k, sorted=False).indices
    return candidates[a[candidates].topk(k, sorted=False).indices]


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
        idx = largest_magnitudes(acc, k)
        dense, ok = yield from gather_sparse(n, acc[idx], idx.to(index_dtype(n)))
        if ef:
            # acc is a fresh tensor when there is an old residual: zero the sent entries in place
            rest = acc.index_fill_(0, idx, 0.0) if old is not None else acc.index_fill(0, idx, 0.0)
            st["residual"] = keep_if(ok, rest, old)
        return unflatten(dense.div_(ctx.world_size), tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        n = total_numel(shapes)
        return gather_sparse_bytes(self.k(n), index_dtype(n), world_size)
