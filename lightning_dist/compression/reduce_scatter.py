"""int8 reduce-scatter with per-block scales (ZeRO++'s qgZ), as rounds a transport drives.

The input is a reduce-scatter's flat input: W equal chunks, chunk j for rank j. Each chunk is cut
into blocks of ``block_size`` elements, each block quantised to int8 with one fp32 scale (its
absmax / 127), and chunk j (its int8 values and scales, not the last block's padding) goes to
rank j in one ``all_to_all``; every rank dequantises the W
chunks it received and sums them in rank order (divided by W for an average). Per element a rank
sends (W-1)/W bytes plus 4/block_size of scale, a quarter of an fp32 reduce-scatter.

Error feedback (optional): what quantisation dropped from this rank's input is kept (``residual``,
the input's size) and added to the next call's input, so nothing is lost over steps, only delayed.

The arithmetic is ``int8.quantize`` / ``int8.dequantize`` on the zero-padded blocks, written to
cost few passes over memory (it runs once per FSDP unit and step, on the training thread and in the
transport's completion thread): one scratch buffer padded in place (no ``F.pad``: it zero-fills the
whole output, then copies), the int8 values and scales written straight into the payload (no
``pack``: a contiguous copy and a concatenation), the received values converted into one buffer
that is scaled in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_dist.compression.int8 import QMAX
from lightning_dist.compression.packing import Spec, aligned, packed_bytes, unpack
from lightning_dist.compression.protocol import Round, Rounds
from lightning_dist.compression.wire import all_to_all_bytes

__all__ = ["Int8Layout", "int8_reduce_scatter", "int8_reduce_scatter_bytes", "quantize_rows", "sum_rows"]


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _scales(x: Tensor) -> tuple[Tensor, Tensor]:
    """(scale, 1 / scale or 0) of each block of ``x`` [..., blocks, block_size]: ``int8.quantize``'s."""
    scale = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()).div_(QMAX)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros((), device=x.device))
    return scale, inv


@dataclass(frozen=True)
class Int8Layout:
    """The shape of one ``int8_reduce_scatter``: W rows of ``n`` elements, ``blocks`` blocks each."""

    world_size: int
    n: int
    block_size: int

    @property
    def blocks(self) -> int:
        return _blocks(self.n, self.block_size)

    @property
    def specs(self) -> list[Spec]:
        """The segments of one payload row: the scales, then the int8 values."""
        return [(torch.float32, self.blocks), (torch.int8, self.n)]


def quantize_rows(
    flat: Tensor, world_size: int, block_size: int, residual: Optional[Tensor] = None
) -> tuple[Tensor, Int8Layout]:
    """The all-to-all payload of ``int8_reduce_scatter`` (uint8 [W, bytes]: row j for rank j) and its
    layout. ``residual``: as ``int8_reduce_scatter``'s (updated in place)."""
    w = world_size
    n = flat.numel() // w
    if n * w != flat.numel():
        raise ValueError(f"int8_reduce_scatter: {flat.numel()} elements do not split into {w} equal chunks")
    layout = Int8Layout(w, n, block_size)
    blocks = layout.blocks
    padded = blocks * block_size
    x = flat.reshape(w, n)
    if x.dtype != torch.float32:
        x = x.float()
    # per row the scales, then the int8 values (not the last block's padding), each segment aligned
    # as ``packing.pack`` lays them out; the alignment bytes zeroed, the rest written below
    scale_bytes = aligned(4 * blocks)
    payload = torch.empty((w, scale_bytes + aligned(n)), dtype=torch.uint8, device=flat.device)
    payload[:, 4 * blocks : scale_bytes].zero_()
    payload[:, scale_bytes + n :].zero_()
    send_scale, send_q = unpack(payload, layout.specs)

    if residual is None and padded == n:
        # no padding and nothing to keep: the input is read in place, scaled into a fresh buffer
        xb = x.view(w, blocks, block_size)
        scale, inv = _scales(xb)
        send_q.copy_(torch.mul(xb, inv.unsqueeze(-1)).round_().view(w, n))
    else:
        work = torch.empty((w, padded), dtype=torch.float32, device=flat.device)
        if residual is None:
            work[:, :n].copy_(x)
        else:
            torch.add(x, residual.view(w, n), out=work[:, :n])
        work[:, n:].zero_()
        xb = work.view(w, blocks, block_size)
        scale, inv = _scales(xb)
        if residual is None:
            send_q.copy_(xb.mul_(inv.unsqueeze(-1)).round_().view(w, padded)[:, :n])
        else:
            q = torch.mul(xb, inv.unsqueeze(-1)).round_().to(torch.int8)
            send_q.copy_(q.view(w, padded)[:, :n])
            deq = q.float().mul_(scale.unsqueeze(-1))  # int8.dequantize
            torch.sub(work[:, :n], deq.view(w, padded)[:, :n], out=residual.view(w, n))
    send_scale.copy_(scale)
    return payload, layout


def sum_rows(received: Union[Tensor, Sequence[Tensor]], layout: Int8Layout, average: bool = True) -> Tensor:
    """This rank's reduced chunk (fp32 [n]) from the W payload rows it received (row i from rank i,
    stacked or a list): each dequantised, summed in rank order, divided by W for an average."""
    w, n, bs = layout.world_size, layout.n, layout.block_size
    rows = list(received.unbind(0)) if isinstance(received, Tensor) else list(received)
    if len(rows) != w:
        raise ValueError(f"int8_reduce_scatter: needs {w} received rows (one per rank), got {len(rows)}")
    blocks = layout.blocks
    mine = torch.empty((w, blocks * bs), dtype=torch.float32, device=rows[0].device)
    scales = []
    for i, row in enumerate(rows):
        scale, q = unpack(row, layout.specs)
        mine[i, :n].copy_(q)
        scales.append(scale)
    mine[:, n:].zero_()
    r_scale = torch.stack(scales)
    mine3 = mine.view(w, blocks, bs).mul_((r_scale / w if average else r_scale).unsqueeze(-1))
    total = mine3[0] if w == 1 else mine3.sum(dim=0)
    return total.view(-1)[:n]


def int8_reduce_scatter(
    flat: Tensor,
    world_size: int,
    block_size: int,
    *,
    average: bool = True,
    residual: Optional[Tensor] = None,
) -> Rounds:
    """Rounds of an int8 reduce-scatter of ``flat`` (W equal chunks, chunk j for rank j); returns
    ``[this rank's reduced chunk]`` in fp32. ``residual`` (fp32, ``flat``'s size), when given, is
    added to the input first and then holds what this call's quantisation dropped (in place).
    ``quantize_rows`` and ``sum_rows`` are its two halves, for a driver that posts the all-to-all
    itself and sums where it lands."""
    payload, layout = quantize_rows(flat, world_size, block_size, residual)
    received = yield Round("all_to_all", payload)
    return [sum_rows(received, layout, average)]


def int8_reduce_scatter_bytes(numel: int, world_size: int, block_size: int) -> int:
    """Bytes one rank sends in ``int8_reduce_scatter`` of a flat input of ``numel`` elements."""
    n = numel // world_size
    blocks = _blocks(n, block_size)
    row = packed_bytes([(torch.float32, blocks), (torch.int8, n)])
    return all_to_all_bytes(world_size * row, world_size)
