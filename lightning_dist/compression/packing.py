"""Pure tensor helpers the compressors share: flattening, byte packing, masking, seeding, decoding.

A payload that carries several tensors (values and indices, scales and codes) is packed into one
uint8 tensor, so that every round is exactly one collective; each segment starts at a multiple of
``ALIGN`` bytes so that unpacking is a view of the received buffer, never a copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGN = 8
"""Every segment of a packed byte payload starts at a multiple of this many bytes."""

Spec = tuple[torch.dtype, int]
"""One segment of a packed row: its dtype and element count."""


# -- flat vectors -------------------------------------------------------------------------------
def flatten_fp32(tensors: Sequence[Tensor]) -> Tensor:
    """One flat fp32 vector of all tensors (a view, not a copy, for a single fp32 tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1).float()
    return torch.cat([t.reshape(-1).float() for t in tensors])


def flatten_native(tensors: Sequence[Tensor]) -> Tensor:
    """One flat vector in the tensors' own dtype."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into tensors shaped and typed like ``like``."""
    out: list[Tensor] = []
    offset = 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape).to(t.dtype))
        offset += n
    return out


def to_chunks(flat: Tensor, chunk_size: int) -> Tensor:
    """``flat`` zero-padded to whole chunks, as [chunks, chunk_size]."""
    chunks = -(-flat.numel() // chunk_size)
    return F.pad(flat, (0, chunks * chunk_size - flat.numel())).view(chunks, chunk_size)


# -- byte packing -------------------------------------------------------------------------------
def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def pack(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors shaped [*lead, k_i] into one uint8 [*lead, bytes], each segment aligned."""
    lead = parts[0].shape[:-1]
    pieces: list[Tensor] = []
    for p in parts:
        b = p.contiguous().view(torch.uint8)
        pad = aligned(b.shape[-1]) - b.shape[-1]
        pieces.append(b)
        if pad:
            pieces.append(torch.zeros((*lead, pad), dtype=torch.uint8, device=b.device))
    return torch.cat(pieces, dim=-1)


def unpack(buf: Tensor, specs: Sequence[Spec]) -> list[Tensor]:
    """Inverse of ``pack``: views [*lead, k_i] of each ``(dtype, k_i)`` segment of ``buf``."""
    out: list[Tensor] = []
    offset = 0
    for dtype, k in specs:
        n = k * dtype.itemsize
        out.append(buf[..., offset : offset + n].view(dtype))
        offset += aligned(n)
    if offset != buf.shape[-1]:
        raise ValueError(f"unpack: payload has {buf.shape[-1]} bytes per row, expected {offset}")
    return out


def packed_bytes(specs: Sequence[Spec]) -> int:
    """Bytes of one packed row of these segments."""
    return sum(aligned(k * dtype.itemsize) for dtype, k in specs)


def specs_of(parts: Sequence[Tensor]) -> list[Spec]:
    """The segments ``pack(parts)`` holds per row, for ``unpack`` on the other side."""
    return [(p.dtype, p.shape[-1]) for p in parts]


# -- skipped steps and seeds --------------------------------------------------------------------
def all_finite(*tensors: Tensor) -> Tensor:
    """A 0-d bool tensor, True when every entry is finite (no host sync)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)


def keep_if(ok: Tensor, new: Tensor, old: Optional[Tensor]) -> Tensor:
    """``new`` where ``ok`` else ``old`` (zeros when there is none): state survives a skipped step."""
    return torch.where(ok, new, torch.zeros((), device=new.device) if old is None else old)


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (unlike ``hash`` of a str)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
