"""1-bit sign compression with a scale per chunk and error feedback (EF-signSGD).

Each rank sends sign(x) packed 8 to a byte and, per chunk, the scale mean(|x|), where x is the
gradient plus the residual; it keeps x - scale * sign(x) as the next residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_multiple
from lightning_dist.compression.packing import (
    all_finite,
    flatten_fp32,
    keep_if,
    packed_bytes,
    to_chunks,
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


def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(positive: Tensor) -> Tensor:
    """Bool [8m] -> uint8 [m], element i in bit i % 8 of byte i // 8."""
    return (positive.view(-1, 8).to(torch.uint8) * _bit_weights(positive.device)).sum(
        dim=-1, dtype=torch.uint8
    )


def unpack_signs(bits: Tensor) -> Tensor:
    """uint8 [m] -> fp32 [8m] of +1 (bit set) and -1."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    b = (bits.unsqueeze(-1) >> shifts) & 1
    return b.view(-1).float().mul_(2).sub_(1)


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
        acc = flat + old if old is not None else flat
        x = to_chunks(acc, cs)
        chunks = x.shape[0]
        counts = torch.full((chunks,), float(cs), device=x.device)
        counts[-1] = n - (chunks - 1) * cs
        scale = x.abs().sum(dim=-1).div_(counts)
        positive = x >= 0
        g_scale, g_bits = yield from packed_round("allgather", [scale, pack_bits(positive.view(-1))])
        if ef:
            sent = torch.where(positive, scale.unsqueeze(-1), -scale.unsqueeze(-1))
            st["residual"] = keep_if(all_finite(g_scale), (x - sent).view(-1)[:n], old)
        out = torch.zeros(chunks, cs, device=x.device)
        for s, b in zip(g_scale, g_bits, strict=True):
            out.addcmul_(unpack_signs(b).view(chunks, cs), s.unsqueeze(-1))
        return unflatten(out.view(-1)[:n].div_(ctx.world_size), tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        cs = self.config.chunk_size
        chunks = -(-total_numel(shapes) // cs)
        row = packed_bytes([(torch.float32, chunks), (torch.uint8, chunks * cs // 8)])
        return all_gather_bytes(row, world_size)
