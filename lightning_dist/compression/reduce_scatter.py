"""int8 reduce-scatter with per-block scales (ZeRO++'s qgZ), as rounds a transport drives.

The input is a reduce-scatter's flat input: W equal chunks, chunk j for rank j. Each chunk is cut
into blocks of ``block_size`` elements, each block quantised to int8 with one fp32 scale (its
absmax / 127), and chunk j (its int8 values and scales, not the last block's padding) goes to
rank j in one ``all_to_all``; every rank dequantises the W
chunks it received and sums them in rank order (divided by W for an average). Per element a rank
sends (W-1)/W bytes plus 4/block_size of scale, a quarter of an fp32 reduce-scatter.

Error feedback (optional): what quantisation dropped from this rank's input is kept (``residual``,
the input's size) and added to the next call's input, so nothing is lost over steps, only delayed.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dist.compression.int8 import dequantize, quantize
from lightning_dist.compression.packing import packed_bytes
from lightning_dist.compression.protocol import Rounds, packed_round
from lightning_dist.compression.wire import all_to_all_bytes

__all__ = ["int8_reduce_scatter", "int8_reduce_scatter_bytes"]


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def int8_reduce_scatter(
    flat: Tensor,
    world_size: int,
    block_size: int,
    *,
    average: bool = True,
    residual: Optional[Tensor] = None,
) -> Rounds:
    """Rounds of an int8 reduce-scatter of ``flat`` (W equal chunks, chunk j for rank j); returns
    ``[this rank's reduced chunk]`` in fp32. ``residual`` (fp32, ``flat``'s size), when given, is
    added to the input first and then holds what this call's quantisation dropped (in place)."""
    w = world_size
    n = flat.numel() // w
    if n * w != flat.numel():
        raise ValueError(f"int8_reduce_scatter: {flat.numel()} elements do not split into {w} equal chunks")
    blocks = _blocks(n, block_size)
    x = flat.reshape(w, n).float()
    if residual is not None:
        x = x + residual.view(w, n)
    padded = F.pad(x, (0, blocks * block_size - n)).view(w, blocks, block_size)
    q, scale = quantize(padded)
    if residual is not None:
        dropped = padded.sub_(dequantize(q, scale)).view(w, blocks * block_size)[:, :n]
        residual.view(w, n).copy_(dropped)
    # the int8 values of the chunk only: the last block's padding is not sent
    r_scale, r_q = yield from packed_round("all_to_all", [scale, q.view(w, blocks * block_size)[:, :n]])
    r_q = F.pad(r_q, (0, blocks * block_size - n))
    mine = dequantize(r_q.view(w, blocks, block_size), r_scale / w if average else r_scale)
    total = mine[0] if w == 1 else mine.sum(dim=0)
    return [total.view(-1)[:n]]


def int8_reduce_scatter_bytes(numel: int, world_size: int, block_size: int) -> int:
    """Bytes one rank sends in ``int8_reduce_scatter`` of a flat input of ``numel`` elements."""
    n = numel // world_size
    blocks = _blocks(n, block_size)
    row = packed_bytes([(torch.float32, blocks), (torch.int8, n)])
    return all_to_all_bytes(world_size * row, world_size)
