"""DeMo-style compression (Peng, Kingma et al., 2024, "Decoupled Momentum Optimization").

Each rank keeps its own momentum m <- beta * m + g, in the DCT domain of fixed-size chunks of the
flat gradient. It sends the ``topk`` largest-magnitude coefficients of each chunk (fp32 value plus
the index inside the chunk) and removes them from m, so what is not sent keeps accumulating. The
gathered coefficients are averaged over ranks, transformed back, and (DeMo's signum update) replaced
by their sign. Use it with plain SGD (no momentum: the momentum lives here) and an Adam-sized lr.

Differences from the reference implementation: the DCT is 1-d over chunks of the flattened bucket
(not 2-d blocks of each matrix), and coefficients are averaged over all W ranks (a rank that did not
send one counts as zero) rather than over the ranks that sent it.
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
    check_int,
    flatten_fp32,
    keep_if,
    pack,
    packed_bytes,
    unflatten,
    unpack,
)


@dataclass
class DeMoConfig:
    chunk_size: int = 64
    """Length of each DCT chunk of the flat gradient."""
    topk: int = 4
    """Coefficients sent per chunk, in [1, chunk_size]."""
    beta: float = 0.999
    """Momentum decay in [0, 1]; 1 keeps everything not yet sent (pure error feedback)."""
    sign: bool = True
    """Return the sign of the averaged update (DeMo's signum); False returns the average itself."""

    def __post_init__(self) -> None:
        check_int("demo", "chunk_size", self.chunk_size, 1)
        check_int("demo", "topk", self.topk, 1, self.chunk_size)
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
            raise ValueError(f"demo: beta={b!r} must be in [0, 1]")
        check_bool("demo", "sign", self.sign)


def dct_matrix(n: int, device: torch.device) -> Tensor:
    """Orthonormal DCT-II as an [n, n] matrix D: coefficients = x @ D.T, x = coefficients @ D."""
    i = torch.arange(n, dtype=torch.float64)
    k = i.unsqueeze(1)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(device=device, dtype=torch.float32)


def chunk_index_dtype(chunk_size: int) -> torch.dtype:
    return torch.uint8 if chunk_size <= 256 else torch.int32


class DeMo(Compressor):
    """Decoupled momentum, chunked DCT, top-k per chunk, gathered; state: the momentum per key."""

    name = "demo"
    aggregation = "allgather"

    def __init__(self, config: Optional[DeMoConfig] = None, **options: Any) -> None:
        super().__init__()
        self.config = build_config(self.name, DeMoConfig, config, options)
        self._dct: dict[torch.device, Tensor] = {}

    def _matrix(self, device: torch.device) -> Tensor:
        d = self._dct.get(device)
        if d is None:
            d = self._dct[device] = dct_matrix(self.config.chunk_size, device)
        return d

    def _specs(self, numel: int) -> list[tuple[torch.dtype, int]]:
        cs, k = self.config.chunk_size, self.config.topk
        sent = -(-numel // cs) * k
        return [(torch.float32, sent), (chunk_index_dtype(cs), sent)]

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cfg = self.config
        cs, k = cfg.chunk_size, cfg.topk
        st = self._key_state(key, tensors)
        st["step"] += 1
        flat = flatten_fp32(tensors)
        n = flat.numel()
        chunks = -(-n // cs)
        d = self._matrix(flat.device)
        coeff = F.pad(flat, (0, chunks * cs - n)).view(chunks, cs) @ d.T
        old = st.get("momentum")
        momentum = coeff if old is None else torch.add(coeff, old, alpha=cfg.beta)
        _, idx = momentum.abs().topk(k, dim=-1, sorted=False)
        values = momentum.gather(-1, idx)
        specs = self._specs(n)
        gathered = yield Round("allgather", pack([values.view(-1), idx.to(specs[1][0]).view(-1)]))
        g_values, g_idx = unpack(gathered, specs)
        st["momentum"] = keep_if(all_finite(g_values), momentum.scatter_(-1, idx, 0.0), old)
        base = (torch.arange(chunks, device=flat.device) * cs).repeat_interleave(k)
        dense = torch.zeros(chunks * cs, device=flat.device)
        for v, i in zip(g_values, g_idx, strict=True):
            dense[base + i.long()] += v
        out = (dense.view(chunks, cs).div_(ctx.world_size) @ d).view(-1)[:n]
        if cfg.sign:
            out = out.sign()
        return unflatten(out, tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        return allgather_bytes(packed_bytes(self._specs(sum(math.prod(s) for s in shapes))), world_size)
