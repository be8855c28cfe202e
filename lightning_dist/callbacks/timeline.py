"""``Timeline(path)``: every collective and every step's phases, all ranks, one Chrome trace file.

What Horovod Timeline gives Horovod users, for every strategy of the pack: the collectives layer
records each call (``lightning_dist.collectives.trace``), this callback adds each training batch's
forward, backward, gradient-sync and optimizer spans, and at the end of training rank 0 gathers
every rank's records and writes one JSON file that opens in Perfetto (ui.perfetto.dev) or
chrome://tracing.

The file is the Chrome Trace Event format, JSON object form::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

- one process per rank: ``"pid"`` is the global rank, named ``"rank <r>"`` by a ``process_name``
  metadata event;
- ``"tid"`` 0 (``"steps"``): complete events (``"ph": "X"``) ``train_batch``, and nested in it
  ``forward``, ``backward``, ``grad_sync`` (from the end of backward to the optimizer step: where a
  strategy waits for its gradient exchanges) and ``optimizer``; ``args``: ``step`` (the optimizer
  step the batch belongs to) and ``batch_idx``;
- ``"tid"`` 1, 2, ... (``"collectives"``, ``"collectives 2"`` ...): one complete event per
  collective, named after its op (``all_reduce``, ``broadcast``, ``all_gather``, ``send`` ...),
  from posting to completion; ``args``: ``op``, ``bytes_sent``, ``bytes_received`` (the wire
  model of ``Communicator.stats``), ``detail``, ``thread`` (that posted it), ``group_rank`` and
  ``world_size``. Asynchronous calls overlap; each goes to the first lane free at its start, so the
  events of one lane never overlap;
- ``"ts"``/``"dur"`` in microseconds from the earliest event of any rank, on Unix time
  (``otherData.t0_unix_ns``): ranks of one machine line up exactly.

Records from ``on_fit_start`` to ``on_train_end`` (the gather runs there, before the strategy tears
its transport down). A run that fails writes nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union, cast

import lightning as L
from typing_extensions import override

from lightning_dist.collectives import trace

STEPS_TID = 0
"""The track of the step spans; collective lanes are 1, 2, ..."""


class Timeline(L.Callback):
    """Writes a Chrome trace of every rank's collectives and step phases to ``path`` (rank 0).

    After ``fit``, rank 0 also holds the written trace as ``self.trace`` (``None`` on other ranks).
    """

    def __init__(self, path: Union[str, os.PathLike[str]]) -> None:
        self.path = Path(path)
        self.trace: Optional[dict[str, Any]] = None
        self._recorder: Optional[trace.Recorder] = None
        self._batch_start = 0
        self._forward_start: Optional[int] = None
        self._backward_start: Optional[int] = None
        self._backward_end: Optional[int] = None
        self._optimizer_start: Optional[int] = None
        self._batch_idx = 0

    # -- recording --------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trace = None
        self._recorder = trace.start()

    def _span(self, name: str, start: int, end: int, trainer: L.Trainer, batch_idx: int) -> None:
        if self._recorder is not None:
            self._recorder.span(name, start, end, step=trainer.global_step, batch_idx=batch_idx)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = self._forward_start = trace.now_ns()
        self._backward_start = self._backward_end = self._optimizer_start = None
        self._batch_idx = batch_idx

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        now = trace.now_ns()
        if self._forward_start is not None:
            self._span("forward", self._forward_start, now, trainer, self._batch_idx)
            self._forward_start = None
        self._backward_start = now

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = trace.now_ns()
        if self._backward_start is not None:
            self._span("backward", self._backward_start, now, trainer, self._batch_idx)
            self._backward_start = None
        self._backward_end = now
        self._forward_start = now  # manual optimization may run another forward in this batch

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        now = trace.now_ns()
        if self._backward_end is not None:
            self._span("grad_sync", self._backward_end, now, trainer, self._batch_idx)
            self._backward_end = None
        self._forward_start = None
        self._optimizer_start = now

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = trace.now_ns()
        # ``global_step`` has advanced past an optimizer step taken in this batch
        step = trainer.global_step - (1 if self._optimizer_start is not None else 0)
        rec = self._recorder
        if rec is None:
            return
        if self._forward_start is not None and self._backward_start is None and self._backward_end is None:
            rec.span("forward", self._forward_start, now, step=step, batch_idx=batch_idx)  # no backward
        if self._optimizer_start is not None:
            rec.span("optimizer", self._optimizer_start, now, step=step, batch_idx=batch_idx)
        rec.span("train_batch", self._batch_start, now, step=step, batch_idx=batch_idx)
        self._forward_start = self._backward_start = self._backward_end = self._optimizer_start = None

    # -- merging ----------------------------------------------------------------------------
    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rec = self._recorder
        if rec is None:
            return
        trace.stop(rec)
        self._recorder = None
        parts = gather_to_rank0({"rank": trainer.global_rank, **rec.export()}, trainer)
        if parts is not None:
            self.trace = chrome_trace(parts)
            write_json(self.path, self.trace)

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._stop()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._recorder is not None:
            trace.stop(self._recorder)
            self._recorder = None


def gather_to_rank0(part: dict[str, Any], trainer: L.Trainer) -> Optional[list[dict[str, Any]]]:
    """Every rank's ``part``, in rank order, on rank 0 (``None`` elsewhere): one object broadcast per
    rank through ``trainer.strategy.broadcast`` (a pack strategy's: its communicator, any backend)."""
    world_size, rank = trainer.world_size, trainer.global_rank
    if world_size == 1:
        return [part]
    parts = [
        cast(dict, trainer.strategy.broadcast(part if rank == r else None, r)) for r in range(world_size)
    ]
    return parts if rank == 0 else None


def _lanes(events: list[tuple[Any, ...]]) -> list[int]:
    """A lane (1, 2, ...) per event (sorted by start) such that events of one lane never overlap."""
    ends: list[int] = []  # the last end time of each lane
    out = []
    for e in events:
        start, end = e[1], e[2]
        for i, last in enumerate(ends):
            if last <= start:
                ends[i] = end
                out.append(i + 1)
                break
        else:
            ends.append(end)
            out.append(len(ends))
    return out


def chrome_trace(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace (JSON object form) of the ranks' exported recorders (see the module doc)."""
    starts = [t[1] + p["clock_offset_ns"] for p in parts for t in (*p["events"], *p["spans"])]
    t0 = min(starts, default=0)
    out: list[dict[str, Any]] = []
    for p in parts:
        pid, offset = int(p["rank"]), int(p["clock_offset_ns"])

        def us(ns: int, offset: int = offset) -> float:
            return (ns + offset - t0) / 1000.0

        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"rank {pid}"}})
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": STEPS_TID, "args": {"name": "steps"}}
        )
        # longer spans first at equal starts, so that a viewer nests forward inside train_batch
        for name, start, end, args in sorted(p["spans"], key=lambda s: (s[1], -s[2])):
            out.append(
                {
                    "ph": "X",
                    "cat": "step",
                    "name": name,
                    "pid": pid,
                    "tid": STEPS_TID,
                    "ts": us(start),
                    "dur": (end - start) / 1000.0,
                    "args": dict(args),
                }
            )
        events = sorted(p["events"], key=lambda e: (e[1], e[2]))
        lanes = _lanes(events)
        for lane in sorted(set(lanes)):
            name = "collectives" if lane == 1 else f"collectives {lane}"
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane, "args": {"name": name}})
        for e, lane in zip(events, lanes):
            ev = trace.CollectiveEvent(*e)
            out.append(
                {
                    "ph": "X",
                    "cat": "collective",
                    "name": ev.op,
                    "pid": pid,
                    "tid": lane,
                    "ts": us(ev.start_ns),
                    "dur": (ev.end_ns - ev.start_ns) / 1000.0,
                    "args": {
                        "op": ev.op,
                        "bytes_sent": ev.bytes_sent,
                        "bytes_received": ev.bytes_received,
                        "detail": ev.detail,
                        "thread": ev.thread,
                        "group_rank": ev.rank,
                        "world_size": ev.world_size,
                    },
                }
            )
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"source": "lightning_dist Timeline", "ranks": len(parts), "t0_unix_ns": t0},
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)
