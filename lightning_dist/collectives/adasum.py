"""Adasum over any backend with point-to-point send/recv (torch.distributed on Gloo or NCCL).

Two ranks' vectors a and b combine, per tensor, as

    adasum(a, b) = a * (1 - a.b / (2|a|^2)) + b * (1 - a.b / (2|b|^2))

so orthogonal inputs add and identical inputs stay as they are. W ranks combine over a binary tree
in Horovod's order: ranks r >= P (P the largest power of two <= W) first fold into rank r - P, then
pairs at distance 1, 2, 4, ... combine (rank r on the left when bit d of r is 0).

The exchange is Horovod's vector-halving / distance-doubling: at level d each rank swaps half of
its current slice of the fused buffer with rank ^ d, combines the half it keeps, and needs the dot
products and norms of whole tensors, so the per-tensor partial sums (3 float64 per tensor) are summed
over the 2d ranks that share the level by a recursive-doubling exchange. The halves then travel back
(distance doubling), so every rank sends 2 N (P - 1) / P bytes of data, like a ring all-reduce, plus
N once each way for a folded rank. Messages are cut into ``CHUNK_BYTES`` pieces so dot products
overlap the transfer.

Dot products and norms are accumulated in float64; fp16/bf16 inputs are combined in float32 and
travel in their own dtype. As in Horovod, a squared norm below ``NORM_SQ_FLOOR`` (sqrt of the
smallest normal double) counts as zero: its coefficient is 1, so adasum(0, b) == b.
"""

from __future__ import annotations

import bisect
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives.backend import Backend
from lightning_dist.collectives.completer import Completer

logger = logging.getLogger(__name__)

NORM_SQ_FLOOR = math.sqrt(sys.float_info.min)
"""Squared norms below this count as zero, as in Horovod 0.28's ``FusedPairwiseReduceWithComm``."""

CHUNK_BYTES = 1 << 20
"""Largest message; smaller messages let Gloo stream faster and let compute overlap the transfer."""

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

ADASUM_TAG = 7
"""Point-to-point tag of Adasum's messages, apart from other send/recv traffic on the backend; lane
``i`` of ``ADASUM_LANES`` uses ``ADASUM_TAG + i``."""

ADASUM_LANES = 2
"""Adasum calls that may run at once where the backend keeps tags apart (``Backend.independent_tags``):
call ``k`` runs in lane ``k % ADASUM_LANES`` once call ``k - ADASUM_LANES`` is done, so one bucket's
exchange fills the link while the previous one waits on its dot products (see ``AdasumLanes``)."""

_MANY_PIECES = 16

TensorOrList = Union[Tensor, Sequence[Tensor]]


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def adasum_coefficients(dot: float, anormsq: float, bnormsq: float) -> tuple[float, float]:
    """Coefficients (ca, cb) with adasum(a, b) = ca * a + cb * b, given a.b, |a|^2 and |b|^2."""
    ca = 1.0 - 0.5 * dot / anormsq if anormsq >= NORM_SQ_FLOOR else 1.0
    cb = 1.0 - 0.5 * dot / bnormsq if bnormsq >= NORM_SQ_FLOOR else 1.0
    return ca, cb


def adasum_pair(a: Tensor, b: Tensor) -> Tensor:
    """The pairwise rule on one tensor, computed in float64 (the result is float64)."""
    a64 = a.detach().reshape(-1).double()
    b64 = b.detach().reshape(-1).double()
    ca, cb = adasum_coefficients(float(a64 @ b64), float(a64 @ a64), float(b64 @ b64))
    return (ca * a64 + cb * b64).reshape(a.shape)


def adasum_reference(per_rank_tensors: Sequence[TensorOrList]) -> Any:
    """Single-process Adasum of every rank's tensor (or list of tensors) over the same tree as
    ``adasum_all_reduce``; computed in float64, returned in the inputs' dtypes."""
    if not per_rank_tensors:
        raise ValueError("adasum_reference: per_rank_tensors is empty; pass one entry per rank")
    single = isinstance(per_rank_tensors[0], Tensor)
    lists = [[x] if isinstance(x, Tensor) else list(x) for x in per_rank_tensors]
    world = len(lists)
    if any(len(ts) != len(lists[0]) for ts in lists):
        raise ValueError(
            f"adasum_reference: per_rank_tensors holds {[len(ts) for ts in lists]} tensors per rank; "
            "pass the same number of tensors (one per bucket or parameter) for every rank"
        )
    vals = [[t.detach().double() for t in ts] for ts in lists]
    p2 = _pow2_floor(world)
    for r in range(world - p2):
        vals[r] = [adasum_pair(a, b) for a, b in zip(vals[r], vals[r + p2], strict=True)]
    d = 1
    while d < p2:
        for r in range(0, p2, 2 * d):
            vals[r] = [adasum_pair(a, b) for a, b in zip(vals[r], vals[r + d], strict=True)]
        d *= 2
    out = [v.to(t.dtype) for v, t in zip(vals[0], lists[0], strict=True)]
    return out[0] if single else out


class _Link:
    """Non-blocking send/recv to one peer at a time, cut into chunks, with byte tallies.

    Messages go through the backend's ``send``/``recv`` futures with ``tag`` (an Adasum lane's). On a CUDA
    transport (NCCL) the lower rank of a pair posts its sends first and the higher rank its
    receives first, since NCCL serialises one pair's operations. A CPU transport (Gloo) sends only
    host memory (``host_only``), so CUDA tensors are reduced through a CPU copy.
    """

    def __init__(self, backend: Backend, tag: int = ADASUM_TAG) -> None:
        self.tag = tag
        self.backend = backend
        self.rank = backend.rank
        self.world_size = backend.world_size
        self.strict = backend.device_type == "cuda"
        self.host_only = backend.device_type == "cpu"
        self.sent = 0
        self.received = 0

    def _post_send(self, tensor: Tensor, peer: int) -> Future:
        self.sent += tensor.numel() * tensor.element_size()
        return self.backend.send(tensor, peer, tag=self.tag)

    def _post_recv(self, tensor: Tensor, peer: int) -> Future:
        self.received += tensor.numel() * tensor.element_size()
        return self.backend.recv(tensor, peer, tag=self.tag)

    def exchange(
        self,
        peer: int,
        send: Optional[Tensor],
        recv: Optional[Tensor],
        chunk: int,
        on_chunk: Optional[Callable[[int, int], None]] = None,
        prepare: Optional[Callable[[int, int], None]] = None,
    ) -> None:
        """Send ``send`` to ``peer`` and receive into ``recv``, both cut into ``chunk`` elements.

        ``prepare(start, stop)`` computes a chunk of ``send`` just before it is posted (so the
        computation overlaps the transfer); ``on_chunk(start, stop)`` runs as each received chunk
        lands. Both sides must pass matching sizes and the same ``chunk``.
        """
        sends = list(send.split(chunk)) if send is not None and send.numel() else []
        recvs = list(recv.split(chunk)) if recv is not None and recv.numel() else []
        if prepare is not None and self.strict:
            for i, part in enumerate(sends):
                prepare(i * chunk, i * chunk + part.numel())
            prepare = None
        # Receives go first (a CPU transport's completer waits in posting order, and the received
        # chunks are what this rank waits for first), except on NCCL where the pair's order rules.
        recv_first = not self.strict or self.rank > peer
        recv_work = [self._post_recv(t, peer) for t in recvs] if recv_first else []
        send_work = []
        for i, part in enumerate(sends):
            if prepare is not None:
                prepare(i * chunk, i * chunk + part.numel())
            send_work.append(self._post_send(part, peer))
        if not recv_first:
            recv_work = [self._post_recv(t, peer) for t in recvs]
        start = 0
        for work, part in zip(recv_work, recvs, strict=True):
            work.wait()
            if on_chunk is not None:
                on_chunk(start, start + part.numel())
            start += part.numel()
        for work in send_work:
            work.wait()

    def sum_in_block(self, vec: Tensor, level: int) -> None:
        """Sum ``vec`` in place over the 2*level ranks of this rank's aligned block (recursive
        doubling; every rank ends with bitwise the same sum since each step adds two values)."""
        other = torch.empty_like(vec)
        d = 1
        while d <= level:
            self.exchange(self.rank ^ d, vec, other, vec.numel())
            vec.add_(other)
            d *= 2


class _FlatAdasum:
    """Adasum of one fused buffer (one dtype and device) holding several tensors back to back."""

    def __init__(self, link: _Link, flat: Tensor, counts: list[int]) -> None:
        self.link = link
        self.flat = flat
        self.bounds = [0]
        for c in counts:
            self.bounds.append(self.bounds[-1] + c)
        self.ntensors = len(counts)
        self.chunk = max(1, CHUNK_BYTES // flat.element_size())
        self.half = flat.dtype in (torch.float16, torch.bfloat16)
        self.scratch: Optional[Tensor] = None

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(tensor index, start, stop) of every non-empty tensor part inside [lo, hi)."""
        out = []
        i = max(0, bisect.bisect_right(self.bounds, lo) - 1)
        while i < self.ntensors and self.bounds[i] < hi:
            s, e = max(lo, self.bounds[i]), min(hi, self.bounds[i + 1])
            if e > s:
                out.append((i, s, e))
            i += 1
        return out

    def combine(
        self,
        keep: tuple[int, int],
        theirs: Tensor,
        peer: int,
        send: Optional[Tensor],
        left: bool,
        block: int,
    ) -> tuple[list[float], list[float]]:
        """Receive ``theirs`` (the peer's values on ``keep``) while sending ``send`` and return the
        coefficients (mine, theirs) per tensor that make flat[keep] adasum(left, right); partial
        sums are added over ``block`` ranks."""
        k0, k1 = keep
        flat = self.flat
        acc = torch.zeros(self.ntensors, 2, 2, dtype=torch.float64, device=flat.device)
        if self.scratch is None and k1 > k0:
            self.scratch = torch.empty(2, min(self.chunk, k1 - k0), dtype=torch.float64, device=flat.device)

        def on_chunk(s: int, e: int) -> None:
            assert self.scratch is not None
            work = self.scratch[:, : e - s]
            work[0].copy_(flat[k0 + s : k0 + e])
            work[1].copy_(theirs[s:e])
            for i, p, q in self.pieces(k0 + s, k0 + e):
                part = work[:, p - k0 - s : q - k0 - s]
                acc[i].addmm_(part, part.t())

        self.link.exchange(peer, send, theirs, self.chunk, on_chunk)
        mine_sq, theirs_sq = acc[:, 0, 0], acc[:, 1, 1]
        vec = torch.stack(
            [acc[:, 0, 1], mine_sq, theirs_sq] if left else [acc[:, 0, 1], theirs_sq, mine_sq], 1
        )
        if block:
            self.link.sum_in_block(vec.view(-1), block)
        coeffs = [adasum_coefficients(*row) for row in vec.tolist()]
        mine = [c[0] if left else c[1] for c in coeffs]
        other = [c[1] if left else c[0] for c in coeffs]
        return mine, other

    def scaled_add(self, k0: int, k1: int, theirs: Tensor, cm: list[float], ct: list[float]) -> None:
        """flat[k0:k1] = cm[i] * flat + ct[i] * theirs on each tensor i's part (float32 for halves)."""
        flat = self.flat
        for s in range(k0, k1, self.chunk):
            e = min(k1, s + self.chunk)
            dst = flat[s:e].float() if self.half else flat[s:e]
            src = theirs[s - k0 : e - k0].float() if self.half else theirs[s - k0 : e - k0]
            parts = self.pieces(s, e)
            if len(parts) >= _MANY_PIECES:
                segs = [dst[p - s : q - s] for _, p, q in parts]
                others = [src[p - s : q - s] for _, p, q in parts]
                torch._foreach_mul_(segs, [cm[i] for i, _, _ in parts])
                torch._foreach_mul_(others, [ct[i] for i, _, _ in parts])
                torch._foreach_add_(segs, others)
            else:
                for i, p, q in parts:
                    dst[p - s : q - s].mul_(cm[i]).add_(src[p - s : q - s], alpha=ct[i])
            if self.half:
                flat[s:e].copy_(dst)

    def deferred_scaled_add(
        self, k0: int, theirs: Tensor, cm: list[float], ct: list[float]
    ) -> Callable[[int, int], None]:
        """``scaled_add`` of the chunk [k0 + s, k0 + e), to run just before that chunk is sent."""

        def run_chunk(s: int, e: int) -> None:
            self.scaled_add(k0 + s, k0 + e, theirs[s:e], cm, ct)

        return run_chunk

    def run(self) -> None:
        link, flat = self.link, self.flat
        rank, world = link.rank, link.world_size
        n = flat.numel()
        p2 = _pow2_floor(world)
        if rank >= p2:
            link.exchange(rank - p2, flat, None, self.chunk)
            link.exchange(rank - p2, None, flat, self.chunk)
            return
        folded = rank < world - p2
        theirs = flat.new_empty(n if folded else n - n // 2)
        if folded:
            self.scaled_add(0, n, theirs, *self.combine((0, n), theirs, rank + p2, None, left=True, block=0))
        lo, hi = 0, n
        splits: list[tuple[int, int, int, bool]] = []
        pending: Optional[Callable[[int, int], None]] = None
        level = 1
        while level < p2:
            left = (rank & level) == 0
            mid = lo + (hi - lo) // 2
            (k0, k1), give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            mine_theirs = theirs[: k1 - k0]
            cm, ct = self.combine((k0, k1), mine_theirs, rank ^ level, flat[give[0] : give[1]], left, level)
            if 2 * level < p2:
                self.scaled_add(k0, k1, mine_theirs, cm, ct)
            else:
                pending = self.deferred_scaled_add(k0, mine_theirs, cm, ct)
            splits.append((lo, mid, hi, left))
            lo, hi = k0, k1
            level *= 2
        for lo, mid, hi, left in reversed(splits):
            level //= 2
            mine, other = (flat[lo:mid], flat[mid:hi]) if left else (flat[mid:hi], flat[lo:mid])
            link.exchange(rank ^ level, mine, other, self.chunk, prepare=pending)
            pending = None
        if folded:
            link.exchange(rank + p2, flat, None, self.chunk)


def back_to_back(members: Sequence[Tensor]) -> Optional[Tensor]:
    """A flat view over ``members`` when they lie back to back in one storage, in this order (a DDP
    bucket's gradients), so they can be reduced in place without a fused copy; else None."""
    first = members[0]
    storage = first.untyped_storage().data_ptr()
    expected = first.data_ptr()
    for t in members:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.data_ptr() != expected:
            return None
        expected += t.numel() * t.element_size()
    total = sum(t.numel() for t in members)
    return first.detach().as_strided((total,), (1,), first.storage_offset())


def check_adasum_dtypes(tensors: Sequence[Tensor]) -> None:
    """Raise a ValueError naming the first tensor whose dtype Adasum cannot combine."""
    for i, t in enumerate(tensors):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"op='adasum': tensor {i} has dtype {t.dtype}; accepted: float16, bfloat16, float32, float64"
            )


def adasum_all_reduce(backend: Backend, tensors: list[Tensor], tag: int = ADASUM_TAG) -> tuple[int, int]:
    """Adasum of each tensor over all ranks of ``backend``, written in place; returns the bytes this
    rank really sent and received (for its communicator to count under ``adasum``).

    Tensors are fused per (dtype, device) into one buffer for the exchange (reduced where they are
    when they already lie back to back in one storage), but the rule is applied per tensor. Messages
    use ``tag``: calls that run at once need different tags.
    """
    check_adasum_dtypes(tensors)
    if backend.world_size == 1 or not tensors:
        return 0, 0
    start = time.perf_counter()
    link = _Link(backend, tag)
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for members in groups.values():
            span = back_to_back(members)
            fused = span is None
            flat = torch.cat([t.reshape(-1) for t in members]) if span is None else span
            staged = flat.cpu() if link.host_only and flat.device.type != "cpu" else flat
            _FlatAdasum(link, staged, [t.numel() for t in members]).run()
            if staged is not flat:
                flat.copy_(staged)
            if fused:
                offset = 0
                for t in members:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
    logger.debug(
        "adasum: %d tensors, %d bytes sent in %.4fs", len(tensors), link.sent, time.perf_counter() - start
    )
    return link.sent, link.received


class AdasumLanes:
    """Runs Adasum calls on worker threads, so that the caller goes on (a DDP bucket's Adasum
    overlaps the rest of backward) while every rank still posts its collectives in call order.

    Call ``k`` runs in lane ``k % ADASUM_LANES`` with tag ``ADASUM_TAG + lane`` where the backend
    keeps tags apart (``overlapping``: Gloo), else every call in lane 0 on ``ADASUM_TAG`` (NCCL
    serialises a pair's operations, Horovod's Adasum is its own); a lane runs its calls one after
    another. Another kind of collective posted meanwhile waits first in ``wait_idle`` until every
    Adasum call submitted before it has returned, so it is posted after them on every rank.
    """

    def __init__(self) -> None:
        self._workers = [Completer(f"adasum-lane-{i}") for i in range(ADASUM_LANES)]
        self._cond = threading.Condition()
        self._in_flight = 0  # calls submitted and not yet returned
        self._calls = 0

    def submit(self, run: Callable[[int], Any], overlapping: bool) -> Future:
        """A future for ``run(tag)`` on the call's lane (call order is the same on every rank)."""
        lane = self._calls % ADASUM_LANES
        self._calls += 1
        with self._cond:
            self._in_flight += 1

        def job() -> Any:
            try:
                return run(ADASUM_TAG + lane if overlapping else ADASUM_TAG)
            finally:  # before the result is delivered: its callbacks may post other collectives
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

        return self._workers[lane if overlapping else 0].submit(job, lambda value: value)

    def wait_idle(self) -> None:
        """Block until every call submitted so far has returned. From a lane's own thread (a
        callback of an Adasum result) it returns at once: that lane's later calls wait for it."""
        if self._in_flight == 0 or any(worker.is_current() for worker in self._workers):
            return  # (the count is read unlocked: this thread's own calls were counted when submitted)
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0)

    def close(self) -> None:
        """Stop the lanes' threads once their calls are done (they restart on demand)."""
        for worker in self._workers:
            worker.stop()
