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

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_int, check_number
from lightning_dist.compression.packing import flatten_fp32, keep_if, to_chunks, unflatten
from lightning_dist.compression.protocol import Compressor, Context, Key, Rounds
from lightning_dist.compression.sparse import gather_sparse, gather_sparse_bytes
from lightning_dist.compression.wire import Shape, total_numel


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

    def __post_init__(self) -> None:
        check_int("chunk_size", self.chunk_size, 1, owner="demo")
        check_int("topk", self.topk, 1, self.chunk_size, owner="demo")
        check_number("beta", self.beta, 0, 1, owner="demo")
        check_bool("sign", self.sign, owner="demo")


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

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cfg = self.config
        cs, k = cfg.chunk_size, cfg.topk
        st, _ = self._begin_step(key, tensors)
        flat = flatten_fp32(tensors)
        d = self._matrix(flat.device)
        coeff = to_chunks(flat, cs) @ d.T
        chunks = coeff.shape[0]
        old = st.get("momentum")
        momentum = coeff if old is None else torch.add(coeff, old, alpha=cfg.beta)
        _, idx = momentum.abs().topk(k, dim=-1, sorted=False)
        values = momentum.gather(-1, idx).view(-1)
        chunk_start = (torch.arange(chunks, device=flat.device) * cs).repeat_interleave(k)
        dense, ok = yield from gather_sparse(
            chunks * cs, values, idx.to(chunk_index_dtype(cs)).view(-1), chunk_start
        )
        st["momentum"] = keep_if(ok, momentum.scatter_(-1, idx, 0.0), old)
        out = (dense.view(chunks, cs).div_(ctx.world_size) @ d).view(-1)[: flat.numel()]
        if cfg.sign:
            out = out.sign()
        return unflatten(out, tensors)

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        cs = self.config.chunk_size
        sent = -(-total_numel(shapes) // cs) * self.config.topk
        return gather_sparse_bytes(sent, chunk_index_dtype(cs), world_size)
