"""1-bit sign compression with a scale per chunk and error feedback (EF-signSGD).

Each rank sends sign(x) packed 8 to a byte and, per chunk, the scale mean(|x|), where x is the
gradient plus the residual; it keeps x - scale * sign(x) as the next residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_multiple
from lightning_dist.compression.packing import (
    ScratchPool,
    all_finite,
    bits_to_bytes,
    flatten_fp32,
    give_scratch,
    keep_if,
    packed_bytes,
    take_scratch,
    unflatten,
)
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds, packed_round
from lightning_dist.compression.wire import Shape, all_gather_bytes, total_numel


@dataclass
class SignConfig:
    """Options of ``Sign``."""

    chunk_size: int = 1024
    """Elements sharing one fp32 scale (their mean |x|); a positive multiple of 8."""
    error_feedback: bool = True
    """Add what was not sent to the next step's gradient."""

    def __post_init__(self) -> None:
        check_multiple("chunk_size", self.chunk_size, 8, owner="sign")
        check_bool("error_feedback", self.error_feedback, owner="sign")


def pack_bits(positive: Tensor) -> Tensor:
    """Bool [8m] -> uint8 [m], element i in bit i % 8 of byte i // 8."""
    return bits_to_bytes(positive.view(-1))


def _sign_table(device: torch.device) -> Tensor:
    """fp32 [256, 8]: row b holds +1 where bit i of b is set, else -1."""
    bits = (torch.arange(256, device=device).unsqueeze(-1) >> torch.arange(8, device=device)) & 1
    return bits.float().mul_(2).sub_(1)


def unpack_signs(bits: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """uint8 [m] -> fp32 [8m] of +1 (bit set) and -1: one row of a 256 x 8 table per byte (one
    gather instead of shift, mask, convert and scale passes). ``out``, if given, is a contiguous fp32
    tensor of 8m entries to write into."""
    table = _sign_table(bits.device)
    if out is None:
        return table.index_select(0, bits.int()).view(-1)
    return torch.index_select(table, 0, bits.int(), out=out.view(-1, 8)).view(-1)


class Sign(Compressor):
    """One bit per entry plus one fp32 scale per chunk, gathered from every rank."""

    name = "sign"
    config_class = SignConfig
    config: SignConfig
    aggregation = "allgather"

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cs, ef = self.config.chunk_size, self.config.error_feedback
        st, _ = self._begin_step(key, tensors)
        flat = flatten_fp32(tensors)
        n = flat.numel()
        old = st.get("residual") if ef else None
        chunks = -(-n // cs)
        if n == chunks * cs:  # whole chunks: acc is already [chunks, cs]
            acc = flat + old if old is not None else flat
        else:  # one fresh zero-padded buffer, no separate pad copy
            acc = torch.empty(chunks * cs, dtype=torch.float32, device=flat.device)
            torch.add(flat, old, out=acc[:n]) if old is not None else acc[:n].copy_(flat)
            acc[n:] = 0.0
        x = acc.view(chunks, cs)
        counts = torch.full((chunks,), float(cs), device=x.device)
        counts[-1] = n - (chunks - 1) * cs
        work = x.abs()  # reused below for the unpacked signs
        scale = work.sum(dim=-1).div_(counts)
        g_scale, g_bits = yield from packed_round("allgather", [scale, pack_bits((x >= 0).view(-1))])
        fresh = old is not None or n != chunks * cs  # acc is this step's own buffer, not the input
        out: Optional[Tensor] = None
        pool: ScratchPool = self._derive("scratch", dict)  # the other ranks' signs, step to step
        spare = take_scratch(pool, key, chunks * cs, x.device) if len(g_bits) > 1 else None
        for r, (s, b) in enumerate(zip(g_scale, g_bits, strict=True)):
            signs = unpack_signs(b, out=work if out is None else spare).view(chunks, cs)
            if ef and r == ctx.rank:  # own row: the residual x - scale * sign(x), bitwise
                col = scale.unsqueeze(-1)
                rest = x.addcmul_(signs, col, value=-1) if fresh else x.addcmul(signs, col, value=-1)
                st["residual"] = keep_if(all_finite(g_scale), rest.view(-1)[:n], old)
            if out is None:
                out = signs.mul_(s.unsqueeze(-1))
            else:
                out.addcmul_(signs, s.unsqueeze(-1))
        assert out is not None
        if spare is not None:
            give_scratch(pool, key, spare)
        return unflatten(out.view(-1)[:n].div_(ctx.world_size), tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        cs = self.config.chunk_size
        chunks = -(-total_numel(shapes) // cs)
        row = packed_bytes([(torch.float32, chunks), (torch.uint8, chunks * cs // 8)])
        return all_gather_bytes(row, world_size)
