"""Sparse exchanges: every rank sends k (value, index) pairs; all ranks sum them into a dense vector.

Used by the compressors that pick entries (top-k of the gradient, top-k DCT coefficients per chunk).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Optional

import torch
from torch import Tensor

from lightning_dist.compression.packing import all_finite, packed_bytes
from lightning_dist.compression.protocol import Round, packed_round
from lightning_dist.compression.wire import all_gather_bytes


def scatter_ranks(numel: int, indices: Tensor, values: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Sum rows of sparse (indices, values) [W, k] into a dense fp32 vector, rank by rank
    (in rank order, so every rank gets the same bits). The indices of one row must be distinct.

    On CPU this is one ``index_add_`` over the rows laid end to end: it adds entry by entry in that
    order, so each position sums its ranks in rank order, bitwise as a loop over ranks would. Other
    devices add repeated indices atomically in no fixed order, so there it is one scatter per rank
    (distinct indices within a rank: no two writes race). ``out``, if given, is a contiguous fp32
    tensor of ``numel`` (its contents are overwritten) to sum into instead of a fresh one."""
    out = torch.zeros(numel, dtype=torch.float32, device=values.device) if out is None else out.zero_()
    if values.device.type == "cpu":
        return out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1).float())
    for idx, val in zip(indices.long(), values, strict=True):
        out[idx] += val
    return out


def gather_sparse(
    numel: int, values: Tensor, indices: Tensor, offsets: Optional[Tensor] = None
) -> Generator[Round, Tensor, tuple[Tensor, Tensor]]:
    """One allgather round of fp32 ``values`` [k] at ``indices`` [k] (sent in their own dtype, so
    choose the narrowest); returns the sum over ranks as a dense fp32 vector of ``numel``, and a 0-d
    bool that is True when every gathered value is finite. ``offsets`` [k], if given, is added to
    the received indices (indices sent relative to a chunk). Use with ``yield from``."""
    g_values, g_idx = yield from packed_round("allgather", [values, indices])
    idx = g_idx.long() if offsets is None else offsets + g_idx.long()
    return scatter_ranks(numel, idx, g_values), all_finite(g_values)


def gather_sparse_bytes(k: int, index_dtype: torch.dtype, world_size: int) -> int:
    """Bytes one rank sends in ``gather_sparse`` of k values with indices of ``index_dtype``."""
    return all_gather_bytes(packed_bytes([(torch.float32, k), (index_dtype, k)]), world_size)
