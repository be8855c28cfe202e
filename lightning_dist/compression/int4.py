"""Blockwise int4: two 4-bit codes per byte and one fp32 scale per chunk, exchanged as int8 is.

Each chunk of ``chunk_size`` elements gets the scale ``s = absmax / 7`` and codes ``q = round(x / s)``
in ``[-7, 7]``, stored as ``q + 8`` (a nibble in ``[1, 15]``): element ``2i`` in the low nibble of
byte ``i``, element ``2i + 1`` in the high one. Round to nearest: ``|q * s - x| <= s / 2`` per element
(up to fp32 rounding of the products). Symmetric uniform int4 rather than e2m1: its worst absolute
error per block (absmax / 14) is smaller than e2m1's (absmax / 6 between the codes 4 and 6), and
the average over ranks of uniform codes needs no table.

The exchange is ``Int8Quantization``'s: at two ranks (or one) one all-gather of every rank's codes and
scales, each rank averaging the dequantised copies in rank order (every rank gets the same bits);
above two an all-to-all of shard j to rank j, which averages them, re-quantises the average to int4
and all-gathers it (a second quantisation: its own ``s / 2``). Bytes per element per row:
1/2 + 4 / chunk_size (0.5625 at the default 64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_int, check_multiple
from lightning_dist.compression.packing import flatten_fp32, generator, packed_bytes, stable_seed, unflatten
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds, packed_round
from lightning_dist.compression.wire import Shape, all_gather_bytes, all_to_all_bytes, total_numel

QMAX4 = 7
"""Largest int4 code magnitude (the code -8 is unused: symmetric, so a code's negation is a code)."""


@dataclass
class Int4Config:
    """Options of ``Int4Quantization``."""

    chunk_size: int = 64
    """Elements per chunk (even: two codes per byte); each carries one fp32 scale (absmax / 7)."""
    stochastic_rounding: bool = False
    """Round up with probability equal to the fraction (unbiased) instead of to the nearest."""
    seed: int = 0
    """Seed of the rounding noise, mixed with rank, key and step (reproducible, resumable)."""

    def __post_init__(self) -> None:
        check_multiple("chunk_size", self.chunk_size, 2, owner="int4")
        check_bool("stochastic_rounding", self.stochastic_rounding, owner="int4")
        check_int("seed", self.seed, 0, owner="int4")


def quantize4(x: Tensor, gen: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """``x`` [..., chunks, chunk_size] (fp32, even chunk_size) -> packed nibbles uint8
    [..., chunks, chunk_size / 2] and fp32 scales [..., chunks] (absmax / 7).

    A chunk holding inf or nan gets a non-finite scale, so it dequantises to non-finite values."""
    scale = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()).div_(QMAX4)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), device=x.device))
    y = x * inv.unsqueeze(-1)
    if gen is None:
        y.round_()
    else:
        y.add_(torch.rand(y.shape, generator=gen, device=y.device, dtype=y.dtype)).floor_()
    codes = y.clamp_(-QMAX4, QMAX4).nan_to_num_(0.0).add_(QMAX4 + 1).to(torch.uint8)
    return pack_nibbles(codes), scale


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes in ``[0, 16)`` [..., 2m] -> uint8 [..., m]: even elements low nibble, odd high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of ``pack_nibbles``: uint8 [..., m] -> uint8 codes [..., 2m]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def dequantize4(packed: Tensor, scale: Tensor) -> Tensor:
    """Inverse of ``quantize4`` (up to rounding): fp32 [..., chunks, chunk_size]."""
    return unpack_nibbles(packed).float().sub_(QMAX4 + 1).mul_(scale.unsqueeze(-1))


class Int4Quantization(Compressor):
    """int4 codes (two per byte) plus an fp32 scale per chunk; int8's rounds (module docstring)."""

    name = "int4"
    config_class = Int4Config
    config: Int4Config
    aggregation = "all_to_all"

    def _layout(self, numel: int, world_size: int) -> tuple[int, int]:
        """(shard length, chunks per shard), as ``Int8Quantization._layout``."""
        cs = self.config.chunk_size
        shards = 1 if self.single_round(world_size) else world_size
        shard = -(-numel // (shards * cs)) * cs
        return shard, shard // cs

    @staticmethod
    def single_round(world_size: int) -> bool:
        """Whether one all-gather of the quantised vectors is used (two ranks or one)."""
        return world_size <= 2

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cfg = self.config
        w, cs = ctx.world_size, cfg.chunk_size
        _, step = self._begin_step(key, tensors)
        flat = flatten_fp32(tensors)
        n = flat.numel()
        shard, chunks = self._layout(n, w)
        shards = 1 if self.single_round(w) else w
        x = F.pad(flat, (0, shards * shard - n)).view(shards, chunks, cs)
        gens: list[Optional[torch.Generator]] = [None, None]
        if cfg.stochastic_rounding:
            gens = [generator(flat.device, stable_seed(cfg.seed, ctx.rank, key, step, i)) for i in (1, 2)]
        half = shard // 2

        if shards == 1:
            q, scale = quantize4(x[0], gens[0])
            g_scale, g_q = yield from packed_round("allgather", [scale, q.view(half)])
            every = dequantize4(g_q.view(w, chunks, cs // 2), g_scale / w)
            full = every[0] if w == 1 else every.sum(dim=0)
            return unflatten(full.view(-1)[:n], tensors)

        q, scale = quantize4(x, gens[0])
        r_scale, r_q = yield from packed_round("all_to_all", [scale, q.view(w, half)])
        mine = dequantize4(r_q.view(w, chunks, cs // 2), r_scale / w).sum(dim=0)
        q2, scale2 = quantize4(mine, gens[1])
        g_scale, g_q = yield from packed_round("allgather", [scale2, q2.view(half)])
        full = dequantize4(g_q.view(w, chunks, cs // 2), g_scale).view(-1)[:n]
        return unflatten(full, tensors)

    def row_bytes(self, numel: int, world_size: int) -> int:
        """Bytes of one packed row: the fp32 scales, then shard / 2 bytes of nibbles (each aligned)."""
        shard, chunks = self._layout(numel, world_size)
        return packed_bytes([(torch.float32, chunks), (torch.uint8, shard // 2)])

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        if world_size <= 1:
            return 0
        row = self.row_bytes(total_numel(shapes), world_size)
        if self.single_round(world_size):
            return all_gather_bytes(row, world_size)
        return all_to_all_bytes(world_size * row, world_size) + all_gather_bytes(row, world_size)
