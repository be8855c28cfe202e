"""A DDP communication hook that runs a compressor's ``Exchange`` over the strategy's communicator.

Every collective of every bucket is issued in one global order, the same on every rank
(``collectives.exchanges.run_exchanges``): a bucket's first round starts from the hook when no earlier
bucket still has rounds to issue, its later rounds start from the completion callback of the previous
one, and a bucket that arrives while an earlier one is in flight queues behind it.

State is kept per *key*: the bucket index of DDP's steady (rebuilt) bucket layout. The layout, as
parameter indices per key, is recorded so a resumed run can split DDP's first, pre-rebuild bucket
into the keys the checkpointed state belongs to. During the strategy's warm-up (``uncompressed``) a
bucket is all-reduced as ``DDP()``'s hook does it, its layout recorded all the same.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real types.
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives import Communicator
from lightning_dist.collectives.exchanges import run_exchanges, start_round
from lightning_dist.compression import Compressor, Exchange, reference_bytes
from lightning_dist.warn import warn_once
from lightning_dist.wire.comm_hook import CollectivesHookState, collectives_hook, start_call

Layout = dict[int, list[int]]


@dataclass
class _Unit:
    """One key's exchange(s) for one hook call: a single exchange, or (Adasum) one per tensor in lockstep."""

    key: int
    positions: list[int]
    exchanges: list[Exchange]


@dataclass
class CompressedHookState:
    """What the hook needs per model, and what it reports."""

    compressor: Compressor
    adasum: bool = False
    comm: Optional[Communicator] = None
    """The communicator the exchanges go through (set by the strategy when it registers the hook)."""
    param_index: dict[int, int] = field(default_factory=dict)
    """``id(parameter)`` -> its index in ``module.parameters()`` (set when the hook is registered)."""
    layout: Layout = field(default_factory=dict)
    """Key -> parameter indices, as the last complete backward pass used them."""
    planned: Optional[Layout] = None
    """A layout restored from a checkpoint: buckets are mapped (or split) onto its keys."""
    uncompressed: bool = False
    """Send this step's buckets as ``DDP()`` does (the strategy's warm-up): the compressor and its
    state are not touched, the layout is recorded as for a compressed step."""
    calls: int = 0
    reference_bytes: int = 0
    """Bytes a ring all-reduce of the fp32 gradients would have sent (summed over hook calls)."""
    _current: Layout = field(default_factory=dict)
    _tail: Optional[Future] = None
    _warned: bool = False

    def units(self, bucket_index: int, indices: list[int]) -> list[tuple[int, list[int]]]:
        """(key, positions in the bucket) for each exchange this bucket needs."""
        planned = self.planned
        if planned:
            where = {p: i for i, p in enumerate(indices)}
            parts = [k for k, ps in planned.items() if ps and ps[0] in where]
            covered = sorted(p for k in parts for p in planned[k])
            if covered == sorted(indices) and all(all(p in where for p in planned[k]) for k in parts):
                return [(k, [where[p] for p in planned[k]]) for k in sorted(parts)]
            if not self._warned:
                warn_once(  # DDP's buckets are the same on every rank: shown once, by rank 0
                    "Compressed: DDP's gradient buckets do not match the checkpointed bucket layout; "
                    "the compressor state of the mismatched buckets starts afresh",
                    stacklevel=2,
                )
                self._warned = True
            self.planned = None
        return [(bucket_index, list(range(len(indices))))]


class _Bucket:
    """The bucket's flat buffer and per-parameter gradients, and where each unit's results go."""

    def __init__(self, buffer: Tensor, grads: list[Tensor], flat: bool) -> None:
        self.buffer = buffer
        self.grads = grads
        self.flat = flat
        self.offsets = [0]
        for g in grads:
            self.offsets.append(self.offsets[-1] + g.numel())

    def inputs(self, positions: list[int]) -> list[Tensor]:
        if not self.flat:
            return [self.grads[p] for p in positions]
        if positions == list(range(len(self.grads))):
            return [self.buffer]
        return [torch.cat([self.grads[p].reshape(-1) for p in positions])]

    def write_back(self, units: list[_Unit]) -> Tensor:
        """Copy every unit's results into the bucket's buffer, then let the exchanges go."""
        buffer, offsets = self.buffer, self.offsets
        for unit in units:
            results = [t for ex in unit.exchanges for t in ex.result]  # type: ignore[union-attr]
            if self.flat and len(unit.exchanges) == 1:
                flat = results[0].reshape(-1)
                if flat.data_ptr() == buffer.data_ptr():
                    continue
                start = 0
                for pos in unit.positions:
                    n = offsets[pos + 1] - offsets[pos]
                    buffer[offsets[pos] : offsets[pos + 1]].copy_(flat[start : start + n])
                    start += n
            else:
                for pos, t in zip(unit.positions, results, strict=True):
                    buffer[offsets[pos] : offsets[pos + 1]].copy_(t.reshape(-1))
        units.clear()
        return buffer


def compressed_hook(
    state: CompressedHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Compress one bucket and exchange it through ``state.comm`` (see the module docstring)."""
    comm = start_call(state, "compressed_hook")
    world_size, rank = comm.world_size, comm.rank
    compressor = state.compressor
    grads = bucket.gradients()
    data = _Bucket(bucket.buffer(), grads, flat=not compressor.per_tensor and not state.adasum)
    indices = [state.param_index.get(id(p), -1) for p in bucket.parameters()]

    keys = state.units(bucket.index(), indices)
    for key, positions in keys:
        state._current[key] = [indices[p] for p in positions]
    state.reference_bytes += reference_bytes([g.shape for g in grads], world_size)
    if bucket.is_last():
        state.layout, state._current = state._current, {}
    if state.uncompressed:
        plain = CollectivesHookState(reduce_op="adasum" if state.adasum else "avg", comm=comm)
        return collectives_hook(plain, bucket)

    units: list[_Unit] = []
    for key, positions in keys:
        if state.adasum:
            exchanges = [
                compressor.exchange(f"{key}.{j}", grads[p], world_size=world_size, rank=rank, adasum=True)
                for j, p in enumerate(positions)
            ]
        else:
            exchanges = [compressor.exchange(key, data.inputs(positions), world_size=world_size, rank=rank)]
        units.append(_Unit(key, positions, exchanges))

    device = data.buffer.device
    finished: Future = Future(devices=[device] if device.type == "cuda" else None)
    groups = [unit.exchanges for unit in units]
    tail = state._tail
    if tail is None or tail.done():
        # the first collective goes out now, overlapping the rest of the backward pass
        pending = [g for g in groups if g[0].round is not None]
        inflight = start_round(comm, pending[0]) if pending else None
        run_exchanges(comm, groups, inflight=inflight, done=finished)
    else:
        run_exchanges(comm, groups, after=tail, done=finished)
    state._tail = finished
    return finished.then(lambda f: _written_back(f, data, units))


def _written_back(finished: Future, data: _Bucket, units: list[_Unit]) -> Tensor:
    finished.value()  # re-raises a failed exchange
    return data.write_back(units)
