"""PowerSGD (Vogels et al., 2019): rank-r factors of each gradient matrix, one power iteration a step.

Two all-reduce rounds per bucket. Matrices of equal shape are batched (``torch.bmm``):
  round 1  P = M Q for every matrix, plus the tensors left uncompressed (1-d ones, and those whose
           factors would not be ``min_compression_rate`` times smaller), in one fp32 payload
  round 2  Q = M^T orth(P), computed and sent as its transpose orth(P)^T M
and the result is (orth(P) / W) Q^T. With error feedback M is the gradient plus the residual M - result;
with warm start each step's Q starts from the last one. Before ``start_step`` a plain all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.checks import check_bool, check_int, check_number
from lightning_dist.compression.packing import (
    all_finite,
    flatten_fp32,
    generator,
    keep_if,
    stable_seed,
    unflatten,
)
from lightning_dist.compression.protocol import Compressor, Context, Key, Round, Rounds
from lightning_dist.compression.wire import Shape, ring_all_reduce_bytes

EPS = 1e-8


@dataclass
class PowerSGDConfig:
    """Options of ``PowerSGD``."""

    rank: int = 4
    """Rank r of the approximation (clamped to each matrix's smaller side)."""
    start_step: int = 0
    """Exchanges per key that use a plain all-reduce before compression starts (``Compressed``'s
    ``warmup`` counts optimizer steps instead, and is 10% of them by default)."""
    min_compression_rate: float = 2.0
    """Compress a matrix only if rows*cols >= rate * (rows+cols)*r; 0 compresses every matrix."""
    error_feedback: bool = True
    """Add the approximation error to the next step's gradient."""
    warm_start: bool = True
    """Start each power iteration from the last step's Q instead of a fresh random one."""
    seed: int = 0
    """Seed of the random Q (the same on every rank)."""

    def __post_init__(self) -> None:
        check_int("rank", self.rank, 1, owner="powersgd")
        check_int("start_step", self.start_step, 0, owner="powersgd")
        check_number("min_compression_rate", self.min_compression_rate, 0, owner="powersgd")
        check_bool("error_feedback", self.error_feedback, owner="powersgd")
        check_bool("warm_start", self.warm_start, owner="powersgd")
        check_int("seed", self.seed, 0, owner="powersgd")


@dataclass
class _Group:
    rows: int
    cols: int
    rank: int
    members: list[int]

    @property
    def name(self) -> str:
        return f"{self.rows}x{self.cols}"


@dataclass
class _Plan:
    groups: list[_Group] = field(default_factory=list)
    uncompressed: list[int] = field(default_factory=list)


def orthogonalize_(p: Tensor) -> Tensor:
    """Orthonormalise the columns of each [B, n, r] matrix in place (modified Gram-Schmidt, twice)."""
    r = p.shape[-1]
    for _ in range(2):
        for i in range(r):
            col = p[..., i : i + 1]
            col.div_(torch.linalg.vector_norm(col, dim=-2, keepdim=True).add_(EPS))
            if i + 1 < r:
                rest = p[..., i + 1 :]
                rest.sub_(col @ (col.transpose(-1, -2) @ rest))
    return p


def orthogonalize_all_(ps: list[Tensor]) -> list[Tensor]:
    """Orthonormalise [B_i, n_i, r_i] batches at once: zero-padded to one batch, which changes nothing
    (zero rows add nothing to norms or products; zero columns stay zero)."""
    if len(ps) <= 1:
        return [orthogonalize_(p) for p in ps]
    rows = max(p.shape[1] for p in ps)
    cols = max(p.shape[2] for p in ps)
    padded = ps[0].new_zeros(sum(p.shape[0] for p in ps), rows, cols)
    out: list[Tensor] = []
    start = 0
    for p in ps:
        view = padded[start : start + p.shape[0], : p.shape[1], : p.shape[2]]
        view.copy_(p)
        out.append(view)
        start += p.shape[0]
    orthogonalize_(padded)
    return out


class PowerSGD(Compressor):
    """Low-rank gradient compression; all-reduce based, state: residuals and Q per shape group."""

    name = "powersgd"
    config_class = PowerSGDConfig
    config: PowerSGDConfig
    aggregation = "allreduce"
    per_tensor = True
    warmup_fraction = 0.1
    """torch's guidance for its PowerSGD hook (``PowerSGDState.start_powerSGD_iter``): start with an
    uncompressed 10% of training, as early steps are the most sensitive to inaccurate gradients."""

    def plan(self, shapes: Sequence[Shape]) -> _Plan:
        """Which tensors are compressed, grouped by matrix shape, and which are sent as they are."""
        sig = tuple(tuple(s) for s in shapes)
        return self._derive(("plan", sig), lambda: self._make_plan(sig))

    def _make_plan(self, sig: tuple[tuple[int, ...], ...]) -> _Plan:
        cfg = self.config
        plan = _Plan()
        by_shape: dict[tuple[int, int], _Group] = {}
        for i, s in enumerate(sig):
            if len(s) < 2:
                plan.uncompressed.append(i)
                continue
            rows, cols = s[0], math.prod(s[1:])
            r = min(cfg.rank, rows, cols)
            if rows * cols < cfg.min_compression_rate * (rows + cols) * r or rows * cols == 0:
                plan.uncompressed.append(i)
                continue
            group = by_shape.get((rows, cols))
            if group is None:
                group = by_shape[(rows, cols)] = _Group(rows, cols, r, [])
                plan.groups.append(group)
            group.members.append(i)
        return plan

    def _initial_q(self, key: Key, g: _Group, step: int, device: torch.device) -> Tensor:
        seed = stable_seed(self.config.seed, key, g.name, 0 if self.config.warm_start else step)
        gen = generator(device, seed)
        return torch.randn(len(g.members), g.cols, g.rank, generator=gen, device=device)

    @override
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        cfg, w = self.config, ctx.world_size
        st, step = self._begin_step(key, tensors)
        if step < cfg.start_step:
            reduced = yield Round("allreduce", flatten_fp32(tensors) / w)
            return unflatten(reduced, tensors)

        device = tensors[0].device
        plan = self.plan([t.shape for t in tensors])
        residuals: dict[str, Tensor] = st.setdefault("residual", {})
        qs: dict[str, Tensor] = st.setdefault("q", {})
        unc = [tensors[i] for i in plan.uncompressed]
        unc_numel = sum(t.numel() for t in unc)
        p_numel = sum(len(g.members) * g.rows * g.rank for g in plan.groups)

        payload = torch.empty(p_numel + unc_numel, device=device)
        mats: list[Tensor] = []
        used_q: list[Tensor] = []
        offset = 0
        for g in plan.groups:
            members = [tensors[i].reshape(g.rows, g.cols) for i in g.members]
            residual = residuals.get(g.name) if cfg.error_feedback else None
            if residual is None:
                m = torch.stack(members).float()
            else:  # gradient + residual written once (not stacked, then added)
                m = torch.empty(len(members), g.rows, g.cols, device=device)
                for b, t in enumerate(members):
                    torch.add(t, residual[b], out=m[b])
            q = qs.get(g.name) if cfg.warm_start else None
            if q is None:
                q = self._initial_q(key, g, step, device)
            size = len(g.members) * g.rows * g.rank
            torch.bmm(m, q, out=payload[offset : offset + size].view(len(g.members), g.rows, g.rank))
            mats.append(m)
            used_q.append(q)
            offset += size
        if unc:
            payload[offset:].copy_(flatten_fp32(unc)).div_(w)

        reduced = yield Round("allreduce", payload)
        ps: list[Tensor] = []
        offset = 0
        for g in plan.groups:
            size = len(g.members) * g.rows * g.rank
            ps.append(reduced[offset : offset + size].view(len(g.members), g.rows, g.rank))
            offset += size
        unc_avg = reduced[offset:]
        ps = orthogonalize_all_(ps)

        out: list[Optional[Tensor]] = [None] * len(tensors)
        if plan.groups:
            # Q is computed and sent transposed, as P^T M [B, r, cols]: a skinny product with M's rows
            # contiguous, ten times faster on CPU than M^T P (which walks M by columns).
            q_numel = sum(len(g.members) * g.cols * g.rank for g in plan.groups)
            payload2 = torch.empty(q_numel, device=device)
            offset = 0
            for g, m, p in zip(plan.groups, mats, ps, strict=True):
                size = len(g.members) * g.cols * g.rank
                torch.bmm(
                    p.transpose(1, 2),
                    m,
                    out=payload2[offset : offset + size].view(len(g.members), g.rank, g.cols),
                )
                offset += size
            reduced2 = yield Round("allreduce", payload2)
            ok = all_finite(reduced, reduced2)
            offset = 0
            for g, m, p, q_used in zip(plan.groups, mats, ps, used_q, strict=True):
                size = len(g.members) * g.cols * g.rank
                qt = reduced2[offset : offset + size].view(len(g.members), g.rank, g.cols)
                offset += size
                # 1/W goes on the small factor, not on the rows x cols product (one pass fewer)
                approx = torch.bmm(p.div(w), qt)
                if cfg.warm_start:
                    qs[g.name] = keep_if(ok, qt.transpose(1, 2).contiguous(), q_used)
                if cfg.error_feedback:
                    residuals[g.name] = keep_if(ok, m.sub_(approx), residuals.get(g.name))
                for b, i in enumerate(g.members):
                    out[i] = approx[b].view(tensors[i].shape).to(tensors[i].dtype)
        for i, t in zip(plan.uncompressed, unflatten(unc_avg, unc), strict=True):
            out[i] = t
        return out  # type: ignore[return-value]

    @override
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        plan = self.plan(shapes)
        first = sum(len(g.members) * g.rows * g.rank for g in plan.groups)
        first += sum(math.prod(shapes[i]) for i in plan.uncompressed)
        second = sum(len(g.members) * g.cols * g.rank for g in plan.groups)
        return ring_all_reduce_bytes(4 * first, world_size) + ring_all_reduce_bytes(4 * second, world_size)
