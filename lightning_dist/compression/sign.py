"""1-bit sign compression with a scale per chunk and error feedback (EF-signSGD).

Each rank sends sign(x) packed 8 to a byte and, per chunk, the scale mean(|x|), where x is the
gradient plus the residual; it keeps x - scale * sign(x) as the next residual.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
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
class SignConfig:
    chunk_size: int = 1024
    """Elements sharing one fp32 scale (their mean |x|); a positive multiple of 8."""
    error_feedback: bool = True
    """Add what was not sent to the next step's gradient."""

    def __post_init__(self) -> None:
        cs = self.chunk_size
        if isinstance(cs, bool) or not isinstance(cs, int) or cs < 8 or cs % 8:
            raise ValueError(f"sign: chunk_size={cs!r} must be a positive multiple of 8")
        check_bool("sign", "error_feedback", self.error_feedback)


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
    aggregation = "allgather"

    def __init__(self, config: Optional[SignConfig] = None, **options: Any) -> None:
        super().__init__()
        self.config = build_config(self.name, SignConfig, config, options)

    def _specs(self, numel: int) -> list[tuple[torch.dtype, int]]:
        chunks = -(-numel // self.config.chunk_size)
        return [(torch.float32, chunks), (torch.uint8, chunks * self.config.chunk_size // 8)]

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cs, ef = self.config.chunk_size, self.config.error_feedback
        st = self._key_state(key, tensors)
        st["step"] += 1
        flat = flatten_fp32(tensors)
        n = flat.numel()
        old = st.get("residual") if ef else None
        acc = flat + old if old is not None else flat
        chunks = -(-n // cs)
        x = F.pad(acc, (0, chunks * cs - n)).view(chunks, cs)
        counts = torch.full((chunks,), float(cs), device=x.device)
        counts[-1] = n - (chunks - 1) * cs
        scale = x.abs().sum(dim=-1).div_(counts)
        positive = x >= 0
        gathered = yield Round("allgather", pack([scale, pack_bits(positive.view(-1))]))
        g_scale, g_bits = unpack(gathered, self._specs(n))
        if ef:
            sent = torch.where(positive, scale.unsqueeze(-1), -scale.unsqueeze(-1))
            st["residual"] = keep_if(all_finite(g_scale), (x - sent).view(-1)[:n], old)
        out = torch.zeros(chunks, cs, device=x.device)
        for s, b in zip(g_scale, g_bits, strict=True):
            out.addcmul_(unpack_signs(b).view(chunks, cs), s.unsqueeze(-1))
        return unflatten(out.view(-1)[:n].div_(ctx.world_size), tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        return allgather_bytes(packed_bytes(self._specs(sum(math.prod(s) for s in shapes))), world_size)
