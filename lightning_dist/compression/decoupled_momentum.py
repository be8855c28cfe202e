"""DeMo-style compression (Peng, Kingma et al., 2024, "Decoupled Momentum Optimization").

Each rank keeps its own momentum m <- beta * m + g, in the DCT domain of fixed-size chunks of the
flat gradient. It sends the ``topk`` largest-magnitude coefficients of each chunk and removes what it
sent from m, so what is not sent keeps accumulating. The gathered coefficients are averaged over
ranks, transformed back, and (DeMo's signum update) replaced by their sign. Use it with plain SGD (no
momentum: the momentum lives here) and an Adam-sized lr.

What crosses the wire per chunk (``values`` and ``indices``):
  values="sign"     one bit per coefficient (its sign) and one fp32 scale per ``scale_group`` chunks,
                    the mean |value| of the coefficients they send; each coefficient counts as
                    sign * scale, and that (not the exact value) is what leaves the momentum, so the
                    quantisation error stays in it (error feedback).
  values="fp32"     each coefficient's value in fp32; it leaves the momentum exactly.
  indices="subset"  the chunk's set of k positions as one combinatorial number (colex rank) in
                    ceil(log2(C(chunk_size, k))) bits: 20 bits for 4 of 64, against 24 for
                    "bits" and 32 for "bytes".
  indices="bits"    each position in ceil(log2(chunk_size)) bits.
  indices="bytes"   each position as uint8 (int32 above 256).
Bit fields are packed end to end in one uint8 stream per segment; the round is one allgather of the
segments packed together. ``values="fp32", indices="bytes"`` is the original layout (5 bytes per
coefficient, 12.8x fewer bytes than an fp32 ring all-reduce at chunk 64, top 4, 2 ranks); the
default ``values="sign", indices="subset"`` sends 24.5 bits per chunk of 64 (83.6x fewer) with the
same coefficients chosen. At 4 of 64 no packing of per-coefficient signs reaches 100x at 2 ranks
(4 sign bits + log2(C(64, 4)) = 19.3 bits of positions is 88x at best); ``topk=3`` sends 19.5 bits
per chunk (105x). ``benchmarks/demo_tradeoff.py`` measures bytes and validation loss per setting.
An allgather's bytes grow with the world size: these ratios are W/2 times smaller at W ranks.

Differences from the reference implementation: the DCT is 1-d over chunks of the flattened bucket
(not 2-d blocks of each matrix), coefficients are averaged over all W ranks (a rank that did not
send one counts as zero) rather than over the ranks that sent it, and values may be sent as signs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_choice, check_int, check_number
from lightning_dist.compression.packing import (
    ScratchPool,
    all_finite,
    bit_stream_bytes,
    bit_width,
    give_scratch,
    keep_if,
    pack_uint,
    packed_bytes,
    subset_count,
    subset_rank,
    subset_table,
    subset_unrank,
    take_scratch,
    top_rows,
    unflatten,
    unpack_uint,
)
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds, packed_round
from lightning_dist.compression.sign import unpack_signs
from lightning_dist.compression.sparse import scatter_ranks
from lightning_dist.compression.wire import Shape, all_gather_bytes, total_numel

VALUES = ("sign", "fp32")
INDICES = ("subset", "bits", "bytes")
SUBSET_TABLE_ROWS = 2**20
"""Subset codes with at most this many values decode by a table of every subset (built once)."""


@dataclass
class DeMoConfig:
    """Options of ``DeMo``."""

    chunk_size: int = 64
    """Length of each DCT chunk of the flat gradient."""
    topk: int = 4
    """Coefficients sent per chunk, in [1, chunk_size]."""
    beta: float = 0.999
    """Momentum decay in [0, 1]; 1 keeps everything not yet sent (pure error feedback)."""
    sign: bool = True
    """Return the sign of the averaged update (DeMo's signum); False returns the average itself."""
    values: str = "sign"
    """How a sent coefficient's value travels: "sign" (1 bit, plus a shared fp32 scale per
    ``scale_group`` chunks; the rounding error stays in the momentum) or "fp32" (exact)."""
    indices: str = "subset"
    """How a chunk's chosen positions travel: "subset" (one combinatorial number per chunk, in
    ceil(log2(C(chunk_size, topk))) bits), "bits" (ceil(log2(chunk_size)) bits each) or "bytes"
    (uint8 each, int32 for chunks over 256)."""
    scale_group: int = 64
    """With values="sign": consecutive chunks sharing one fp32 scale (their mean |sent value|)."""

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1, owner="demo")
        check_int("topk", self.topk, 1, self.chunk_size, owner="demo")
        check_number("beta", self.beta, 0, 1, owner="demo")
        check_bool("sign", self.sign, owner="demo")
        check_choice("values", self.values, VALUES, owner="demo")
        check_choice("indices", self.indices, INDICES, owner="demo")
        check_int("scale_group", self.scale_group, 1, owner="demo")
        if self.indices == "subset" and subset_count(self.chunk_size, self.topk) >= 2**62:
            raise ValueError(
                f"demo: indices='subset' needs C(chunk_size, topk) < 2**62 (one int64 per chunk); "
                f"C({self.chunk_size}, {self.topk}) is larger: use indices='bits' or a smaller chunk_size"
            )


def dct_matrix(n: int, device: torch.device) -> Tensor:
    """Orthonormal DCT-II as an [n, n] matrix D: coefficients = x @ D.T, x = coefficients @ D."""
    i = torch.arange(n, dtype=torch.float64)
    k = i.unsqueeze(1)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(device=device, dtype=torch.float32)


def chunk_index_dtype(chunk_size: int) -> torch.dtype:
    """The narrowest dtype for an index inside a chunk."""
    return torch.uint8 if chunk_size <= 256 else torch.int32


class DeMo(Compressor):
    """Decoupled momentum, chunked DCT, top-k per chunk, gathered; state: the momentum per key."""

    name = "demo"
    config_class = DeMoConfig
    config: DeMoConfig
    aggregation = "allgather"

    def _matrix(self, device: torch.device) -> Tensor:
        return self._derive(("dct", device), lambda: dct_matrix(self.config.chunk_size, device))

    def index_bits(self) -> int:
        """Bits of one index field: per chunk for "subset", per coefficient for "bits" (0: "bytes")."""
        cfg = self.config
        if cfg.indices == "subset":
            return bit_width(subset_count(cfg.chunk_size, cfg.topk))
        return bit_width(cfg.chunk_size) if cfg.indices == "bits" else 0

    def specs(self, chunks: int) -> list[tuple[torch.dtype, int]]:
        """The segments of one rank's payload for a bucket of ``chunks`` chunks."""
        cfg = self.config
        sent = chunks * cfg.topk
        if cfg.values == "fp32":
            specs = [(torch.float32, sent)]
        else:
            specs = [(torch.float32, -(-chunks // cfg.scale_group)), (torch.uint8, bit_stream_bytes(sent, 1))]
        if cfg.indices == "bytes":
            specs.append((chunk_index_dtype(cfg.chunk_size), sent))
        else:
            fields = chunks if cfg.indices == "subset" else sent
            specs.append((torch.uint8, bit_stream_bytes(fields, self.index_bits())))
        return specs

    def _encode_indices(self, idx: Tensor) -> Tensor:
        """[chunks, k] positions (ascending per chunk for "subset") -> the index segment."""
        cfg = self.config
        if cfg.indices == "bytes":
            return idx.to(chunk_index_dtype(cfg.chunk_size)).reshape(-1)
        if cfg.indices == "bits":
            return pack_uint(idx.reshape(-1), self.index_bits())
        return pack_uint(subset_rank(idx, cfg.chunk_size), self.index_bits())

    def _decode_indices(self, seg: Tensor, chunks: int) -> Tensor:
        """The gathered index segments [W, bytes] -> positions inside each chunk, int64 [W, chunks, k]."""
        cfg = self.config
        w, k = seg.shape[0], cfg.topk
        if cfg.indices == "bytes":
            return seg.long().view(w, chunks, k)
        if cfg.indices == "bits":
            return unpack_uint(seg, self.index_bits(), chunks * k).view(w, chunks, k)
        ranks = unpack_uint(seg, self.index_bits(), chunks)
        if subset_count(cfg.chunk_size, k) > SUBSET_TABLE_ROWS:
            return subset_unrank(ranks, cfg.chunk_size, k)
        table = self._derive(("subsets", seg.device), lambda: subset_table(cfg.chunk_size, k, seg.device))
        return subset_unrank(ranks, cfg.chunk_size, k, lookup=table)

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        # Coefficients live transposed, [chunk_size, chunks] (one row per frequency), so the top-k
        # search reduces across contiguous rows; the state holds the same storage as [chunks, cs].
        cfg = self.config
        cs, k = cfg.chunk_size, cfg.topk
        st, _ = self._begin_step(key, tensors)
        n = sum(t.numel() for t in tensors)
        chunks = -(-n // cs)
        if len(tensors) == 1 and tensors[0].dtype == torch.float32 and n == chunks * cs:
            x = tensors[0].reshape(-1)  # whole chunks already: read the input in place
        else:
            x = torch.empty(chunks * cs, dtype=torch.float32, device=tensors[0].device)
            torch.cat([t.reshape(-1).float() for t in tensors], out=x[:n])
            x[n:] = 0.0
        d = self._matrix(x.device)
        old = st.get("momentum")
        # m <- beta * m + DCT(g), in one GEMM
        xt = x.view(chunks, cs).T
        # on CPU the new momentum goes into the storage of the one before last (the pool's spare),
        # and one scratch buffer holds top_rows' keys now, the gathered coefficients after the round
        pool: ScratchPool = self._derive("scratch", dict)
        spare = take_scratch(pool, ("momentum", key), chunks * cs, x.device).view(cs, chunks)
        if old is None:
            mt = torch.mm(d, xt, out=spare)
        else:
            mt = torch.addmm(old.T, d, xt, beta=cfg.beta, out=spare)
        work = take_scratch(pool, ("work", key), chunks * cs, x.device)
        idx_t = top_rows(mt, k, work=work)  # [k, chunks], largest |m| first
        if cfg.indices == "subset":
            idx_t = _ascending(idx_t)  # the combinatorial number codes a set: send it ascending
        # flat positions of the chosen entries in mt's storage: index_select and index_copy_ on
        # them cost a fraction of gather / scatter_ along dim 0
        flat_t = (idx_t * chunks).add_(torch.arange(chunks, device=x.device))
        values_t = mt.view(-1).index_select(0, flat_t.view(-1)).view(k, chunks)
        if cfg.values == "fp32":
            parts = [values_t.T.reshape(-1)]
            sent_t = values_t
        else:
            group_scale = self._scales(values_t.abs().sum(dim=0), chunks)
            scale = group_scale.repeat_interleave(cfg.scale_group)[:chunks]
            positive_t = values_t >= 0
            sent_t = positive_t.float().mul_(2).sub_(1).mul_(scale)  # +-scale, as the bit says
            parts = [group_scale, pack_uint(positive_t.T.reshape(-1), 1)]
        parts.append(self._encode_indices(idx_t.T))
        received = yield from packed_round("allgather", parts)
        w = ctx.world_size
        g_idx = self._decode_indices(received[-1], chunks)
        if cfg.values == "fp32":
            g_values = received[0].view(w, chunks, k)
            ok = all_finite(received[0])
        else:
            g_scale, g_signs = received[0], received[1]
            signs = unpack_signs(g_signs.reshape(-1)).view(w, -1)[:, : chunks * k]
            scale_r = g_scale.repeat_interleave(cfg.scale_group, dim=-1)[:, :chunks, None]
            g_values = signs.reshape(w, chunks, k).mul_(scale_r)
            ok = all_finite(g_scale)
        # DeMo's momentum loses what was sent; a skipped (non-finite) step leaves it as it was
        mt.view(-1).index_copy_(0, flat_t.view(-1), (values_t - sent_t).view(-1))
        st["momentum"] = keep_if(ok, mt.T, old)
        unused = old if st["momentum"] is not old else mt.T  # the momentum not kept is spare
        if unused is not None and unused.T.is_contiguous():
            give_scratch(pool, ("momentum", key), unused.T.reshape(-1))
        if not cfg.sign:
            g_values = g_values / w  # the sign of the average is the sign of the sum
        positions = g_idx + torch.arange(0, chunks * cs, cs, device=x.device).view(1, chunks, 1)
        dense = scatter_ranks(chunks * cs, positions.view(w, -1), g_values.reshape(w, -1), out=work)
        out = (dense.view(chunks, cs) @ d).view(-1)[:n]
        give_scratch(pool, ("work", key), work)
        if cfg.sign:
            out = out.sign_()
        return unflatten(out, tensors)

    def _scales(self, per_chunk: Tensor, chunks: int) -> Tensor:
        """[groups]: the mean |value| sent by each group of ``scale_group`` chunks, from the sum of
        |value| per chunk, [chunks]."""
        g, k = self.config.scale_group, self.config.topk
        groups = -(-chunks // g)
        sums = F.pad(per_chunk, (0, groups * g - chunks)).view(groups, g).sum(dim=-1)
        counts = torch.full((groups,), float(g * k), device=per_chunk.device)
        counts[-1] = (chunks - (groups - 1) * g) * k
        return sums / counts

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        chunks = -(-total_numel(shapes) // self.config.chunk_size)
        return all_gather_bytes(packed_bytes(self.specs(chunks)), world_size)


def _ascending(idx: Tensor) -> Tensor:
    """Each column of distinct positions [k, cols] in ascending order. Up to 8 rows: an odd-even
    transposition network of row-wise min / max (a few passes over [cols]); above, a k x k count of
    smaller entries places each one. Both are cheaper than a sort along dim 0."""
    k = idx.shape[0]
    if k <= 8:
        rows = list(idx.unbind(0))
        for p in range(k):
            for i in range(p % 2, k - 1, 2):
                rows[i], rows[i + 1] = (
                    torch.minimum(rows[i], rows[i + 1]),
                    torch.maximum(rows[i], rows[i + 1]),
                )
        return torch.stack(rows)
    place = (idx.unsqueeze(0) < idx.unsqueeze(1)).sum(dim=1)  # [k, cols]: entries below each one
    return torch.empty_like(idx).scatter_(0, place, idx)
