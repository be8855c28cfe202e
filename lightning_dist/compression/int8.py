"""int8 quantisation with one fp32 scale per chunk, exchanged as all-to-all then all-gather.

Each rank quantises its gradient and sends shard j to rank j (all_to_all); rank j averages the W
dequantised copies of its shard, re-quantises the average and all-gathers it. Every rank sends
about 2*(W-1)/W bytes per element, a quarter of an fp32 ring all-reduce at any world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_int
from lightning_dist.compression.packing import flatten_fp32, generator, packed_bytes, stable_seed, unflatten
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds, packed_round
from lightning_dist.compression.wire import Shape, all_gather_bytes, all_to_all_bytes, total_numel

QMAX = 127


@dataclass
class Int8Config:
    """Options of ``Int8Quantization``."""

    chunk_size: int = 1024
    """Elements per quantisation chunk; each chunk carries one fp32 scale (its absmax / 127)."""
    stochastic_rounding: bool = False
    """Round up with probability equal to the fraction (unbiased) instead of to the nearest."""
    seed: int = 0
    """Seed of the rounding noise, mixed with rank, key and step (reproducible, resumable)."""

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1, owner="int8")
        check_bool("stochastic_rounding", self.stochastic_rounding, owner="int8")
        check_int("seed", self.seed, 0, owner="int8")


def quantize(x: Tensor, gen: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` [..., chunks, chunk_size] to int8 with scales [..., chunks] (absmax / 127).

    A chunk holding inf or nan gets a non-finite scale, so it dequantises to non-finite values.
    """
    scale = torch.linalg.vector_norm(x, ord=math.inf, dim=-1).div_(QMAX)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), device=x.device))
    y = x * inv.unsqueeze(-1)
    if gen is None:
        y.round_()
    else:
        y.add_(torch.rand(y.shape, generator=gen, device=y.device, dtype=y.dtype)).floor_().clamp_(
            -QMAX, QMAX
        )
    return y.to(torch.int8), scale


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """Inverse of ``quantize`` (up to rounding): ``q`` [..., chunks, chunk_size] times its scales."""
    return torch.mul(q, scale.unsqueeze(-1))


class Int8Quantization(Compressor):
    """int8 values plus a scale per chunk; two rounds (all_to_all, allgather), two quantisations."""

    name = "int8"
    config_class = Int8Config
    config: Int8Config
    aggregation = "all_to_all"

    def _layout(self, numel: int, world_size: int) -> tuple[int, int]:
        """(shard length, chunks per shard): the flat gradient padded to W shards of whole chunks."""
        cs = self.config.chunk_size
        shard = -(-numel // (world_size * cs)) * cs
        return shard, shard // cs

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cfg = self.config
        w, cs = ctx.world_size, cfg.chunk_size
        _, step = self._begin_step(key, tensors)
        flat = flatten_fp32(tensors)
        n = flat.numel()
        shard, chunks = self._layout(n, w)
        x = F.pad(flat, (0, w * shard - n)).view(w, chunks, cs)
        gens: list[Optional[torch.Generator]] = [None, None]
        if cfg.stochastic_rounding:
            gens = [generator(flat.device, stable_seed(cfg.seed, ctx.rank, key, step, i)) for i in (1, 2)]

        q, scale = quantize(x, gens[0])
        r_scale, r_q = yield from packed_round("all_to_all", [scale, q.view(w, shard)])
        mine = dequantize(r_q.view(w, chunks, cs), r_scale / w)
        mine = mine[0] if w == 1 else mine.sum(dim=0)

        q2, scale2 = quantize(mine, gens[1])
        g_scale, g_q = yield from packed_round("allgather", [scale2, q2.view(shard)])
        full = dequantize(g_q.view(w, chunks, cs), g_scale).view(-1)[:n]
        return unflatten(full, tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        if world_size <= 1:
            return 0
        shard, chunks = self._layout(total_numel(shapes), world_size)
        row = packed_bytes([(torch.float32, chunks), (torch.int8, shard)])
        return all_to_all_bytes(world_size * row, world_size) + all_gather_bytes(row, world_size)
