"""Pure tensor helpers the compressors share: flattening, byte packing, masking, seeding, decoding.

A payload that carries several tensors (values and indices, scales and codes) is packed into one
uint8 tensor, so that every round is exactly one collective; each segment starts at a multiple of
``ALIGN`` bytes so that unpacking is a view of the received buffer, never a copy.
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Hashable, Sequence
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
        raise ValueError(
            f"unpack: payload has {buf.shape[-1]} bytes per row, expected {offset} for specs {list(specs)}; "
            "unpack with the specs the payload was packed with"
        )
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
    """``new`` where ``ok`` else ``old`` (zeros when there is none): state survives a skipped step.

    On CPU the flag is read (no device to sync with) and ``new`` itself is kept: a ``torch.where``
    over a multi-megabyte residual costs as much as the compression around it."""
    if ok.device.type == "cpu":
        if bool(ok):
            return new
        return torch.zeros_like(new) if old is None else old
    return torch.where(ok, new, torch.zeros((), device=new.device) if old is None else old)


ScratchPool = dict[Hashable, Tensor]
"""Spare buffers of a compressor, by what they are for (one per key: never two users at once)."""


def take_scratch(pool: ScratchPool, name: Hashable, numel: int, device: torch.device) -> Tensor:
    """A contiguous fp32 buffer of ``numel`` (contents undefined), taken out of ``pool`` while in
    use, or a fresh one. On CPU a fresh multi-megabyte buffer costs its page faults every step."""
    buf = pool.pop(name, None)
    if buf is None or buf.numel() != numel or buf.device != device:
        buf = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


def give_scratch(pool: ScratchPool, name: Hashable, buf: Tensor) -> None:
    """Put ``buf`` (no longer used, referenced nowhere else) back in ``pool`` for the next step;
    only on CPU (device allocators cache freed blocks themselves)."""
    if buf.device.type == "cpu":
        pool[name] = buf


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (unlike ``hash`` of a str)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# -- bit streams and index codes ----------------------------------------------------------------
def bit_width(count: int) -> int:
    """Bits that hold any integer in ``[0, count)``: ceil(log2(count)), 0 when ``count`` <= 1."""
    return max(0, (count - 1).bit_length())


def bit_stream_bytes(count: int, bits: int) -> int:
    """Bytes of ``pack_uint`` of ``count`` integers of ``bits`` bits each."""
    return -(-count * bits // 8)


_GATHER_BITS = 0x0102040810204080
"""Times 8 bytes of 0/1 read as one little-endian int64: bit i of the top byte is byte i (every
product term lands on its own bit, so nothing carries)."""


def bits_to_bytes(bits: Tensor) -> Tensor:
    """0/1 bytes (bool or uint8) [*lead, 8m] -> uint8 [*lead, m], element i in bit i % 8 of byte
    i // 8. Fast path: each 8 bytes read as one int64 and gathered into its top byte by a multiply
    (one pass over m words instead of several over 8m bytes)."""
    if (
        sys.byteorder == "little"
        and bits.is_contiguous()
        and bits.shape[-1] % 8 == 0
        and bits.storage_offset() % 8 == 0
    ):
        words = bits.view(torch.uint8).view(torch.int64)
        return words.mul(_GATHER_BITS).bitwise_right_shift_(56).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8) * weights).sum(dim=-1, dtype=torch.uint8)


def pack_uint(values: Tensor, bits: int) -> Tensor:
    """Integers in ``[0, 2**bits)``, shaped [*lead, n], as one little-endian bit stream per row:
    uint8 [*lead, ceil(n * bits / 8)]; bit j of value i is bit (i*bits + j) % 8 of byte
    (i*bits + j) // 8. Vectorised: no Python loop over elements."""
    lead, n = values.shape[:-1], values.shape[-1]
    nbytes = bit_stream_bytes(n, bits)
    if nbytes == 0:
        return torch.zeros((*lead, 0), dtype=torch.uint8, device=values.device)
    dtype = torch.int32 if bits <= 31 else torch.int64  # narrower bit planes when they fit
    shifts = torch.arange(bits, dtype=dtype, device=values.device)
    stream = ((values.to(dtype).unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(*lead, n * bits)
    stream = F.pad(stream, (0, nbytes * 8 - n * bits))
    return bits_to_bytes(stream)


def unpack_bits(stream: Tensor, n: int) -> Tensor:
    """``unpack_uint(stream, 1, n)`` as bool."""
    shifts8 = torch.arange(8, dtype=torch.uint8, device=stream.device)
    return ((stream.unsqueeze(-1) >> shifts8) & 1).reshape(*stream.shape[:-1], -1)[..., :n].bool()


def unpack_uint(stream: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of ``pack_uint``: int64 [*lead, n] from uint8 [*lead, ceil(n * bits / 8)]."""
    lead = stream.shape[:-1]
    if bits == 0 or n == 0:
        return torch.zeros((*lead, n), dtype=torch.int64, device=stream.device)
    if 2 <= bits <= 56 and sys.byteorder == "little":
        # each field lies in the 8 bytes from its first byte: read them as one int64, shift, mask
        start = torch.arange(n, dtype=torch.int64, device=stream.device) * bits
        windows = F.pad(stream, (0, 8)).unfold(-1, 8, 1)  # [*lead, bytes + 1, 8], a view
        words = windows.index_select(-2, start >> 3).contiguous().view(torch.int64).squeeze(-1)
        return (words >> (start & 7)) & ((1 << bits) - 1)
    shifts8 = torch.arange(8, dtype=torch.uint8, device=stream.device)
    bit = ((stream.unsqueeze(-1) >> shifts8) & 1).reshape(*lead, -1)[..., : n * bits]
    if bits == 1:
        return bit.long()
    weights = torch.ones(bits, dtype=torch.int64, device=stream.device) << torch.arange(
        bits, dtype=torch.int64, device=stream.device
    )
    return (bit.view(*lead, n, bits).long() * weights).sum(dim=-1)


def subset_count(n: int, k: int) -> int:
    """How many k-subsets a set of n has: C(n, k)."""
    return math.comb(n, k)


def _binomials(n: int, k: int, device: torch.device) -> Tensor:
    """int64 [k, n]: row i holds C(c, i + 1) for c = 0 .. n-1 (non-decreasing in c)."""
    return torch.tensor(
        [[math.comb(c, i + 1) for c in range(n)] for i in range(k)], dtype=torch.int64, device=device
    )


def subset_rank(sorted_idx: Tensor, n: int) -> Tensor:
    """The combinatorial number of each row's k-subset of ``range(n)``: ``sorted_idx`` [*lead, k]
    ascending -> int64 [*lead] in ``[0, C(n, k))``, sum_i C(c_i, i + 1) (colex order)."""
    k = sorted_idx.shape[-1]
    table = _binomials(n, k, sorted_idx.device)
    idx = sorted_idx.long()
    total = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=idx.device)
    for i in range(k):
        total += table[i][idx[..., i]]
    return total


_ROW_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtypes as wide as a lookup row of this many bytes."""


def subset_unrank(ranks: Tensor, n: int, k: int, lookup: Optional[Tensor] = None) -> Tensor:
    """Inverse of ``subset_rank``: int64 [*lead] -> the ascending subsets, int64 [*lead, k].

    ``lookup``, if given, is ``subset_table(n, k)``: decoding is then one gather."""
    if lookup is not None:  # one gather of whole rows: index_select, far cheaper than indexing
        flat = ranks.reshape(-1).long()
        row_dtype = _ROW_DTYPES.get(lookup.shape[-1] * lookup.element_size())
        if row_dtype is not None and lookup.is_contiguous():  # each row as one integer
            rows = lookup.view(row_dtype).view(-1).index_select(0, flat).view(lookup.dtype)
        else:
            rows = lookup.index_select(0, flat)
        return rows.view(*ranks.shape, lookup.shape[-1]).long()
    table = _binomials(n, k, ranks.device)
    rest = ranks.long().clone()
    out = torch.empty((*ranks.shape, k), dtype=torch.int64, device=ranks.device)
    for i in range(k - 1, -1, -1):  # greedy: the largest c with C(c, i + 1) <= what is left
        c = torch.searchsorted(table[i], rest.reshape(-1), right=True).view(rest.shape) - 1
        out[..., i] = c
        rest -= table[i][c]
    return out


def subset_table(n: int, k: int, device: torch.device) -> Tensor:
    """Every k-subset of ``range(n)`` in the order of its number: uint8 (int16 for n > 256) [C(n, k), k],
    so that row r is ``subset_unrank(r)``. Meant for small C(n, k) (4 of 64: 635,376 rows, 2.5 MB)."""
    subsets = subset_unrank(torch.arange(subset_count(n, k), device=device), n, k)
    return subsets.to(torch.uint8 if n <= 256 else torch.int16)


def top_rows(x: Tensor, k: int, work: Optional[Tensor] = None) -> Tensor:
    """Rows of the k largest-magnitude entries in each column of ``x`` [n, cols], largest first:
    int64 [k, cols]. ``x`` is left as it was.

    Fast path (fp32, n <= 1024, k <= 16): each entry's key is its fp32 pattern with the sign bit
    cleared (|x|: non-negative floats order as their int32 patterns) and its row number in place of
    the lowest ceil(log2(n)) bits, so every column's keys are distinct and k passes of a column max
    (vectorised across columns) find the rows, each then knocked out. Magnitudes closer than
    2**-(23 - ceil(log2(n))) relative (2**-17 for 64 rows) count as tied; ties go to the higher row;
    nan and inf come first. Otherwise ``topk`` of ``x.abs()``.

    ``work``, if given, is a contiguous tensor of ``x.numel()`` 4-byte entries that the fast path
    overwrites with its keys (instead of a fresh buffer), for a caller that reuses it."""
    n = x.shape[0]
    bits = bit_width(n)
    if n > 1024 or k > 16 or x.dtype != torch.float32:
        return x.abs().topk(k, dim=0).indices
    rows = torch.arange(n, dtype=torch.int32, device=x.device).unsqueeze(-1)
    mask = 0x7FFF_FFFF & ~((1 << bits) - 1)
    if work is None:
        keys = x.view(torch.int32).bitwise_and(mask)
    else:
        keys = torch.bitwise_and(x.view(torch.int32), mask, out=work.view(torch.int32).view(x.shape))
    keys.bitwise_or_(rows)
    out = torch.empty((k, x.shape[1]), dtype=torch.int64, device=x.device)
    for j in range(k):
        best = keys.amax(dim=0, keepdim=True)
        out[j : j + 1] = best.bitwise_and((1 << bits) - 1)
        if j + 1 < k:  # the keys are dropped after the last pass: no knock-out needed
            keys.scatter_(0, out[j : j + 1], -1)
    return out
