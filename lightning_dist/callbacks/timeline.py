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

- ``"tid"`` 10000 (``"waits"``, two ranks or more): per collective, a span on every rank that
  arrived before the last one, from its arrival (posting) to the last rank's, named
  ``"wait for rank <s>"``; ``otherData.stragglers`` has each rank's share of the calls it was last
  at and its total wait (``callbacks.stragglers``). The k-th call of an op is one call on all ranks;
- a collective that raised is named ``"<op> (timed out)"`` / ``"<op> (failed)"`` (``cat``
  ``"collective,failed"``, ``args.status``), one still in flight when the trace was written
  ``"<op> (in flight)"``, each with an instant event at its end; a rank that stopped has a
  ``"fit stopped: <reason>"`` instant event.

Records from ``on_fit_start`` to ``on_train_end`` (the gather runs there, before the strategy tears
its transport down). A run that fails (fit raises, a collective times out, SIGTERM) writes
``<stem>-attempt-<n>.json`` instead: see ``failure_trace``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Union, cast

import lightning as L
from typing_extensions import override

from lightning_dist.callbacks import failure_trace as failure
from lightning_dist.callbacks.stragglers import StragglerReport
from lightning_dist.collectives import trace
from lightning_dist.warn import warn_once

STEPS_TID = 0
"""The track of the step spans; collective lanes are 1, 2, ..."""
WAITS_TID = 10_000
"""The track of each rank's waits for the last rank to arrive at a collective."""


class Timeline(L.Callback):
    """Writes a Chrome trace of every rank's collectives and step phases to ``path`` (rank 0).

    After ``fit``, rank 0 also holds the written trace as ``self.trace`` (``None`` on other ranks).
    ``failure_trace`` (default on): when fit raises (a timed-out collective included) or the process
    receives SIGTERM, each rank writes what it has at once and merges what the ranks wrote into
    ``<stem>-attempt-<n>.json`` (``failure_trace.py``); ``self.failure_path`` is that file.
    """

    def __init__(self, path: Union[str, os.PathLike[str]], failure_trace: bool = True) -> None:
        self.path = Path(path)
        self.failure_trace = failure_trace
        self.trace: Optional[dict[str, Any]] = None
        self.failure_path: Optional[Path] = None
        self.attempt: Optional[int] = None
        self._recorder: Optional[trace.Recorder] = None
        self._rank = 0
        self._previous_sigterm: Any = None
        self._handler_installed = False
        self._batch_start = 0
        self._forward_start: Optional[int] = None
        self._backward_start: Optional[int] = None
        self._backward_end: Optional[int] = None
        self._optimizer_start: Optional[int] = None
        self._batch_idx = 0
        self._batch_open = False
        self._batch_step = 0
        self._reasons: list[str] = []

    # -- recording --------------------------------------------------------------------------
    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.trace = None
        self.failure_path = None
        self._reasons = []
        self._batch_open = False
        self._rank = trainer.global_rank
        if self.failure_trace:
            self.attempt = self._attempt(trainer)
        self._recorder = trace.start()

    def _attempt(self, trainer: L.Trainer) -> int:
        """This attempt's number, the same on every rank (before recording: the broadcast is not traced)."""
        known = failure.attempt_from_env()
        if known is not None:
            return known
        mine = failure.next_attempt(self.path) if trainer.global_rank == 0 else None
        if trainer.world_size == 1:
            return cast(int, mine)
        return int(cast(int, trainer.strategy.broadcast(mine, 0)))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after Lightning's own SIGTERM handler (registered after on_fit_start): ours runs first
        if not self.failure_trace or threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._handler_installed = True

    def _restore_sigterm(self) -> None:
        if self._handler_installed:
            self._handler_installed = False
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _on_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        """Write this rank's trace, then do what the previous handler did."""
        self.write_failure(f"signal {signal.Signals(signum).name}")
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            self._restore_sigterm()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def write_failure(self, reason: str) -> Optional[Path]:
        """Write this rank's records so far (calls in flight marked so) and merge the attempt's
        rank files; returns the merged trace's path (``None`` when not recording). Never raises."""
        rec, attempt = self._recorder, self.attempt
        if rec is None or attempt is None or not self.failure_trace:
            return None
        if reason not in self._reasons:
            self._reasons.append(reason)
        try:
            part = {"rank": self._rank, "reason": "; then ".join(self._reasons), **rec.export()}
            if self._batch_open:  # the batch that did not end, up to now
                unfinished = (
                    "train_batch",
                    self._batch_start,
                    trace.now_ns(),
                    {"step": self._batch_step, "batch_idx": self._batch_idx, "unfinished": True},
                )
                part["spans"] = [*part["spans"], unfinished]
            failure.write_rank(self.path, attempt, part)
            failure.merge_attempt(self.path, attempt, chrome_trace)
            self.failure_path = failure.attempt_path(self.path, attempt)
        except Exception as exc:  # noqa: BLE001  (a failing run's trace must not hide its error)
            warn_once(f"Timeline: could not write the failure trace next to {self.path}: {exc!r}")
            return None
        return self.failure_path

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
        self._batch_step = trainer.global_step
        self._batch_open = True

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
        self._batch_open = False
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
        self._restore_sigterm()
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
        self._restore_sigterm()
        text = str(exception).strip().splitlines()
        self.write_failure(f"{type(exception).__name__}: {text[0][:300] if text else ''}".rstrip(": "))
        self._stop()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_sigterm()
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


def _waits(parts: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], StragglerReport]:
    """The "waits" track of every rank and the straggler totals, from the ranks' collective events:
    the k-th call of an op on every rank is one call (ranks post collectives in the same order), its
    arrival on each rank is its posting time; point-to-point calls are left out."""
    per_rank: list[dict[tuple[str, int], int]] = []
    for p in parts:
        offset = int(p["clock_offset_ns"])
        seen: dict[str, int] = {}
        calls: dict[tuple[str, int], int] = {}
        for e in sorted(p["events"], key=lambda e: (e[1], e[2])):
            op = e[0]
            if op in ("send", "recv"):
                continue
            k = seen.get(op, 0)
            seen[op] = k + 1
            calls[(op, k)] = int(e[1]) + offset
        per_rank.append(calls)
    report = StragglerReport(len(parts))
    keys = set.intersection(*(set(c) for c in per_rank)) if per_rank else set()
    out: list[dict[str, Any]] = []
    for key in sorted(keys, key=lambda k: per_rank[0][k]):
        starts = [c[key] for c in per_rank]
        w = report.add(starts)
        for p, start, wait in zip(parts, starts, w.wait_ns):
            if wait <= 0:
                continue
            out.append(
                {
                    "ph": "X",
                    "cat": "wait",
                    "name": f"wait for rank {w.straggler}",
                    "pid": int(p["rank"]),
                    "tid": WAITS_TID,
                    "ts": start,  # shifted by the caller
                    "dur": wait / 1000.0,
                    "args": {"op": key[0], "call": key[1], "straggler": w.straggler, "wait_ms": wait / 1e6},
                }
            )
    return out, report


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
            event: dict[str, Any] = {
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
            if ev.status:
                event.update(name=f"{ev.op} ({ev.status})", cat="collective,failed", cname="terrible")
                event["args"]["status"] = ev.status
                out.append(event)
                out.append(
                    {
                        "ph": "i",
                        "s": "p",
                        "cat": "failure",
                        "name": f"{ev.op} {ev.status}",
                        "pid": pid,
                        "tid": lane,
                        "ts": us(ev.end_ns),
                        "args": {"op": ev.op, "status": ev.status, "detail": ev.detail},
                    }
                )
                continue
            out.append(event)
        if p.get("reason"):
            end = max((t[2] for t in (*p["events"], *p["spans"])), default=t0 - offset)
            out.append(
                {
                    "ph": "i",
                    "s": "p",
                    "cat": "failure",
                    "name": f"fit stopped: {p['reason']}",
                    "pid": pid,
                    "tid": STEPS_TID,
                    "ts": us(end),
                    "args": {"reason": p["reason"]},
                }
            )
    other: dict[str, Any] = {"source": "lightning_dist Timeline", "ranks": len(parts), "t0_unix_ns": t0}
    if len(parts) > 1:
        waits, report = _waits(parts)
        for pid in sorted({int(p["rank"]) for p in parts}):
            out.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": WAITS_TID, "args": {"name": "waits"}}
            )
        for w in waits:
            w["ts"] = (w["ts"] - t0) / 1000.0
            out.append(w)
        other["stragglers"] = {
            "calls": report.calls,
            "last_share": [report.last_share(r) for r in range(report.world_size)],
            "wait_s": [report.wait_s(r) for r in range(report.world_size)],
        }
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)
