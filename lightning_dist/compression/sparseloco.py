"""SparseLoCo-style sparse pseudo-gradients: top-k per chunk, 2-bit values, error feedback per rank.

Each rank adds its residual to the pseudo-gradient (``acc = delta + residual``), splits ``acc`` into
chunks of ``chunk_size`` and keeps the ``k`` largest magnitudes of each chunk. The kept values are
quantised to 2 bits against the chunk's scale ``s`` (their absmax, rounded up to fp16): the codes
0..3 stand for ``s * (-1, -1/3, 1/3, 1)``, nearest, so ``|sent - kept| <= s / 3``. Their positions in
the chunk go as ``ceil(log2(chunk_size))``-bit fields. What was not sent, quantisation error
included, is the new residual: ``residual = acc - sent`` (so the sum over steps of what was sent
plus the last residual is the sum of the pseudo-gradients). One all-gather carries every rank's
scales, positions and codes; each rank decodes them and sums them in rank order (every rank gets
the same bits), then divides by the world size.

Bytes of one rank's row, with c chunks, each segment aligned to 8 bytes: 2c (fp16 scales) +
ceil(c k b / 8) (positions, b bits) + ceil(c k / 4) (codes); at the defaults (64, k = 2) 4 bytes per
64 elements. A scale above fp16's range (65504) is inf: that step's result is non-finite and, as for
any non-finite input, the residual stays as it was (a GradScaler-style skip).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_int, check_number
from lightning_dist.compression.packing import (
    all_finite,
    bit_stream_bytes,
    bit_width,
    flatten_fp32,
    keep_if,
    pack_uint,
    packed_bytes,
    unflatten,
    unpack_uint,
)
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds, packed_round
from lightning_dist.compression.sparse import scatter_ranks
from lightning_dist.compression.wire import Shape, all_gather_bytes, total_numel

LEVELS = (-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0)
"""What the 2-bit codes 0..3 stand for, in units of the chunk's scale."""


@dataclass
class SparseLoCoConfig:
    """Options of ``SparseLoCo``."""

    ratio: float = 0.03
    """Fraction of each chunk kept, in (0, 1]: k = max(1, round(ratio * chunk_size)) per chunk."""
    chunk_size: int = 64
    """Elements per chunk (2 to 65536); each carries one fp16 scale."""
    error_feedback: bool = True
    """Keep what was not sent (per rank) and add it to the next pseudo-gradient."""

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, 0, 1, low_open=True, owner="sparseloco")
        check_int("chunk_size", self.chunk_size, 2, 1 << 16, owner="sparseloco")
        check_bool("error_feedback", self.error_feedback, owner="sparseloco")


def chunk_scales(kept: Tensor) -> Tensor:
    """The fp16 scale of each row of ``kept`` [chunks, k]: its absmax rounded up to an fp16 value
    (never below the absmax, so every kept value is within [-s, s]); inf beyond fp16's range."""
    absmax = torch.maximum(kept.amax(dim=-1), kept.amin(dim=-1).neg())
    half = absmax.half()
    low = half.float() < absmax  # false for inf and nan
    # the next fp16 up: a non-negative fp16's bit pattern plus one (on every device, unlike nextafter)
    return torch.where(low, half.view(torch.int16).add(1).view(torch.float16), half)


def encode_values(kept: Tensor, scale: Tensor) -> Tensor:
    """2-bit codes (int64 in 0..3) of ``kept`` [chunks, k] against fp16 ``scale`` [chunks], nearest."""
    s = scale.float().unsqueeze(-1)
    inv = torch.where(s > 0, s.reciprocal(), torch.zeros((), device=s.device))
    return kept.mul(inv).mul_(1.5).add_(1.5).round_().nan_to_num_(0.0).clamp_(0, 3).long()


def decode_values(codes: Tensor, scale: Tensor) -> Tensor:
    """Inverse of ``encode_values`` (up to rounding): codes [..., chunks, k] -> fp32 values."""
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=codes.device)
    return levels[codes].mul_(scale.float().unsqueeze(-1))


class SparseLoCo(Compressor):
    """Top-k per chunk with 2-bit values and per-rank error feedback; one all-gather (module docstring)."""

    name = "sparseloco"
    config_class = SparseLoCoConfig
    config: SparseLoCoConfig
    aggregation = "allgather"

    @property
    def k(self) -> int:
        """Entries kept per chunk."""
        cfg = self.config
        return max(1, min(cfg.chunk_size, round(cfg.ratio * cfg.chunk_size)))

    def chunks(self, numel: int) -> int:
        """Chunks of a vector of ``numel`` (the last one zero-padded)."""
        return -(-numel // self.config.chunk_size)

    def specs(self, numel: int) -> list[tuple[torch.dtype, int]]:
        """The segments of one rank's payload: fp16 scales, position bits, code bits."""
        c, k, b = self.chunks(numel), self.k, bit_width(self.config.chunk_size)
        return [
            (torch.float16, c),
            (torch.uint8, bit_stream_bytes(c * k, b)),
            (torch.uint8, bit_stream_bytes(c * k, 2)),
        ]

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cfg = self.config
        st, _ = self._begin_step(key, tensors)
        cs, k, bits = cfg.chunk_size, self.k, bit_width(cfg.chunk_size)
        flat = flatten_fp32(tensors)
        n, c = flat.numel(), self.chunks(flat.numel())
        old = st.get("residual") if cfg.error_feedback else None
        acc = F.pad(flat + old if old is not None else flat, (0, c * cs - n))  # a fresh tensor
        rows = acc.view(c, cs)
        local = rows.abs().topk(k, dim=-1, sorted=False).indices  # [c, k]
        kept = rows.gather(-1, local)
        scale = chunk_scales(kept)
        codes = encode_values(kept, scale)
        payload = [scale, pack_uint(local.reshape(-1), bits), pack_uint(codes.reshape(-1), 2)]
        g_scale, g_pos, g_codes = yield from packed_round("allgather", payload)
        w = g_scale.shape[0]
        offsets = torch.arange(c, device=flat.device).mul_(cs).repeat_interleave(k)
        positions = unpack_uint(g_pos, bits, c * k) + offsets  # [W, c*k]
        values = decode_values(unpack_uint(g_codes, 2, c * k).view(w, c, k), g_scale).view(w, c * k)
        dense = scatter_ranks(c * cs, positions, values)
        if cfg.error_feedback:
            ok = all_finite(g_scale)
            sent = decode_values(codes, scale)
            rows.scatter_(-1, local, kept - sent)  # residual = acc - sent (acc: fresh)
            st["residual"] = keep_if(ok, acc[:n], old)
        return unflatten(dense[:n].div_(ctx.world_size), tensors)

    def row_bytes(self, numel: int) -> int:
        """Bytes of one rank's packed payload for a vector of ``numel``."""
        return packed_bytes(self.specs(numel))

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        return all_gather_bytes(self.row_bytes(total_numel(shapes)), world_size)
