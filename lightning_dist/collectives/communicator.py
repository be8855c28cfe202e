"""``Communicator``: the collectives API over one backend, with byte/time accounting on every call.

Wire model for the byte counters (per rank, N = payload bytes, W = world size):
  all_reduce      what the backend reports (``Backend.all_reduce_bytes``); a ring by default:
                  sends and receives 2*(W-1)*N // W
  broadcast       the source sends (W-1)*N, every other rank receives N
  all_gather      sends (W-1)*N_own, receives the sum of the others' N (unequal shapes: padded
                  sizes, plus the int64 shape exchange, a call of its own)
  reduce_scatter  sends and receives (W-1)*N // W of its N-byte input
  all_to_all      sends the chunks addressed to other ranks, receives the chunks from them (row
                  counts not given: plus the int64 row-count exchange, a call of its own)
  adasum          what the recursive halving/doubling exchange really sends (see adasum.py)
At world size 1 every count is zero. Seconds run from posting an operation to its completion.

Tracing (``collectives.trace``): while a recorder is active, every operation is also recorded with
its op, bytes, posting and completion times and posting thread; off, it costs one ``None`` check.

Ranks must post collectives in the same order. Every operation is posted by the calling thread,
in call order: the asynchronous forms exist for operations whose shapes every rank knows
(``all_reduce``, ``broadcast``, ``all_gather`` of equal shapes, ``reduce_scatter``, ``all_to_all``
with the row counts given); those whose shapes must be exchanged first are blocking (the shape
exchange, then the data, on the calling thread). Adasum runs on worker threads (``AdasumLanes``), and
any other operation waits for the Adasum calls before it, so it is posted after them on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives import trace as _trace
from lightning_dist.collectives.accounting import CommStats
from lightning_dist.collectives.adasum import AdasumLanes, adasum_all_reduce, check_adasum_dtypes
from lightning_dist.collectives.arrivals import Arrivals
from lightning_dist.collectives.backend import Backend, check_reduce_op, rows
from lightning_dist.collectives.futures import completed_future
from lightning_dist.collectives.timeouts import (
    CollectiveTimeout,
    add_timeout_note,
    is_timeout,
    naming_timeouts,
    translate,
)
from lightning_dist.collectives.work import FutureWork

logger = logging.getLogger(__name__)

TensorOrList = Union[Tensor, Sequence[Tensor]]
_POINT_TO_POINT = frozenset({"send", "recv"})
"""Ops that are not collectives: not in ``Communicator.arrivals``."""


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _describe(tensor: TensorOrList, op: str = "") -> str:
    """What a collective moves, for its timeout message: ``sum, 1234 float32 elements`` (a list:
    ``..., in 3 tensors``)."""
    tensors = [tensor] if isinstance(tensor, Tensor) else list(tensor)
    dtype = str(tensors[0].dtype).removeprefix("torch.") + " " if tensors else ""
    n = sum(t.numel() for t in tensors)
    size = f"{n} {dtype}element{'' if n == 1 else 's'}"
    if len(tensors) > 1:
        size += f" in {len(tensors)} tensors"
    return f"{op}, {size}" if op else size


class Communicator:
    """All collectives over one ``Backend``; counts bytes and seconds into ``stats``.

    ``stats``: the counters this communicator adds to; its own new ``CommStats`` by default (pass one
    to share counters between communicators). ``close()`` stops the helper threads of this
    communicator and of its backend, and no other; they restart if it is used again."""

    def __init__(self, backend: Backend, stats: Optional[CommStats] = None) -> None:
        self.backend = backend
        self.stats = CommStats() if stats is None else stats
        self._lanes = AdasumLanes()
        self._timeouts: deque[CollectiveTimeout] = deque(maxlen=8)
        """The last ``CollectiveTimeout``s raised by this communicator's operations, any thread."""
        self.arrivals = Arrivals()
        """When this rank posted each collective, while on (``CommMonitor(stragglers=N)`` turns it on)."""

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    def spans(self, group: Any) -> bool:
        """Whether a collective over this communicator answers for ``group`` (``Backend.spans``)."""
        return self.backend.spans(group)

    def close(self) -> None:
        """Stop the helper threads this communicator and its backend started, once the work already
        handed to them is done (a strategy's teardown). A later call starts them again."""
        self._lanes.close()
        self.backend.close()

    # -- accounting -------------------------------------------------------------------------
    def timeout_context(self) -> dict[str, Any]:
        """What a ``CollectiveTimeout`` says about the transport: its name, its configured timeout
        (a backend's ``timeout_s``, when it has one) and this rank. Plain values only: see ``_timed``."""
        backend = self.backend
        return {
            "transport": str(getattr(backend, "transport", backend.name)),
            "timeout_s": getattr(backend, "timeout_s", None),
            "rank": backend.rank,
            "world_size": backend.world_size,
        }

    def _wait(self, fut: Future, op: str, detail: str = "") -> Any:
        """``fut.wait()``; a timeout raised as ``CollectiveTimeout`` naming ``op`` and ``detail``,
        from the transport's error. The operation's completion callback raised it already, but torch
        hands an exception raised in a callback to the waiter as a plain ``RuntimeError`` holding its
        text: the one it recorded is raised again here, with its type."""
        try:
            return fut.wait()
        except CollectiveTimeout:
            raise
        except Exception as exc:
            known = self._recorded(op, detail) if is_timeout(exc) else None
            if known is not None:
                raise CollectiveTimeout(str(known), op, known.timeout_s, detail) from (known.__cause__ or exc)
            new = translate(exc, op, detail=detail, **self.timeout_context())
            if new is exc:
                raise
            raise new from exc

    def wait(self, fut: Future, op: str, detail: str = "") -> Any:
        """The blocking form's wait on a future this communicator returned for ``op``: its value,
        or its error (a timeout as ``CollectiveTimeout`` naming ``op`` and ``detail``). For callers
        that post an asynchronous form now and wait for it later."""
        return self._wait(fut, op, detail)

    def as_work(self, fut: Future, op: str, detail: str = "") -> FutureWork:
        """``fut`` (an asynchronous form's future for ``op``) as a ``torch.distributed`` ``Work``
        whose ``wait()`` is ``wait(fut, op, detail)``: for extension points that wait on a Work
        later (FSDP2's custom all-gather)."""
        return FutureWork(fut, lambda: self._wait(fut, op, detail))

    def _recorded(self, op: str, detail: str) -> Optional[CollectiveTimeout]:
        """The latest recorded timeout of the collective ``op`` moving ``detail``, if any."""
        return next((t for t in reversed(self._timeouts) if (t.op, t.detail) == (op, detail)), None)

    def note_timeout(self, exc: BaseException) -> bool:
        """A strategy's ``on_exception``: add a note to ``exc`` when it reports a timed-out
        collective (``timeouts.add_timeout_note``): the last timeout of this communicator's own
        operations, else what torch was doing, with this transport's timeout. ``exc``'s type and
        args stay. Returns whether ``exc`` has such a note now."""
        try:
            context = self.timeout_context() if self.world_size > 1 else {}
        except Exception:  # noqa: BLE001  (a broken transport: a note without it)
            context = {}
        recorded = self._timeouts[-1] if self._timeouts else None
        return add_timeout_note(exc, recorded, **context)

    def _timed(
        self, op: str, sent: int, received: int, start: Callable[[], Future], detail: str = ""
    ) -> Future:
        """Post ``start()``; count ``sent``/``received`` bytes under ``op`` and the seconds until its
        future completes (and trace the call when a recorder is active).

        A timeout reported by the transport fails the returned future with a ``CollectiveTimeout``
        naming ``op`` (with ``detail``), the transport and its configured timeout.
        """
        if self.world_size <= 1:
            sent = received = 0
        rec = _trace.active
        stats = self.stats
        begin = time.perf_counter_ns()
        if self.arrivals.on and op not in _POINT_TO_POINT:
            self.arrivals.add(op, begin)
        stats.enter(begin)
        try:
            fut = start()
        except BaseException:
            stats.leave(time.perf_counter_ns())
            raise
        stats.add(op, sent, received)
        context = self.timeout_context()
        record = self._timeouts.append
        key = 0
        if rec is not None:
            rank, world_size, thread = self.rank, self.world_size, threading.current_thread().name
            key = rec.posted(op, begin, rank, world_size, thread, detail)

        # The callback must not hold the communicator: if it dropped the last reference to a
        # process group inside that group's own worker thread, the group's destructor would abort.
        def _done(f: Future) -> Any:
            end = time.perf_counter_ns()
            stats.add_time(op, (end - begin) / 1e9)
            stats.leave(end)
            if rec is None:
                with naming_timeouts(op, record, detail=detail, **context):
                    return f.value()
            try:
                with naming_timeouts(op, record, detail=detail, **context):
                    value = f.value()
            except BaseException as exc:
                status = "timed out" if is_timeout(exc) else "failed"
                rec.collective(op, begin, end, sent, received, rank, world_size, thread, detail, status, key)
                raise
            rec.collective(op, begin, end, sent, received, rank, world_size, thread, detail, "", key)
            return value

        return fut.then(_done)

    def _traced(self, op: str, sent: int, received: int, begin_ns: int, detail: str = "") -> None:
        """Trace a blocking or caller-driven operation that ran from ``begin_ns`` until now."""
        rec = _trace.active
        if rec is not None:
            rec.collective(
                op, begin_ns, time.perf_counter_ns(), sent, received, self.rank, self.world_size, None, detail
            )

    @contextlib.contextmanager
    def _blocking(self, op: str, begin_ns: int, detail: str = "") -> Iterator[None]:
        """Around a blocking operation posted at ``begin_ns``: its arrival, and while a recorder is
        active, the call as in flight until it returns, or as failed (timed out) if it raises."""
        if self.arrivals.on:
            self.arrivals.add(op, begin_ns)
        rec = _trace.active
        if rec is None:
            yield
            return
        key = rec.posted(op, begin_ns, self.rank, self.world_size, None, detail)
        try:
            yield
        except BaseException as exc:
            status = "timed out" if is_timeout(exc) else "failed"
            end = time.perf_counter_ns()
            rec.collective(op, begin_ns, end, 0, 0, self.rank, self.world_size, None, detail, status, key)
            raise
        rec.settled(key)

    def _post(
        self, op: str, sent: int, received: int, start: Callable[[], Future], detail: str = ""
    ) -> Future:
        """Post ``start()`` after the Adasum calls before it, and account for it."""
        self._lanes.wait_idle()
        return self._timed(op, sent, received, start, detail)

    def count(self, op: str, sent: int, received: int, seconds: float = 0.0) -> None:
        """Add bytes moved by a caller-driven exchange (compound algorithms such as Adasum)."""
        if self.world_size > 1:
            self.stats.add(op, sent, received, seconds)
            self.stats.add_busy(seconds)
            if _trace.active is not None:
                self._traced(op, sent, received, time.perf_counter_ns() - int(seconds * 1e9))

    def _all_reduce_bytes(self, t: Tensor) -> int:
        return self.backend.all_reduce_bytes(_nbytes(t), t.dtype)

    # -- all_reduce -------------------------------------------------------------------------
    def all_reduce_async(self, tensor: TensorOrList, op: str = "sum", name: Optional[str] = None) -> Future:
        """Reduce in place; a list is reduced as one fused buffer (Adasum: per tensor). ``name``
        (the same on every rank and step for the same tensor) goes to the backend (``Backend.all_reduce``).

        Adasum's exchange runs on a worker thread of this communicator (``AdasumLanes``), so the
        returned future is pending while it runs (a DDP bucket's Adasum overlaps the rest of
        backward); other calls made meanwhile wait for it, and where the backend keeps tags apart the
        next Adasum may start at once, in the other lane."""
        op = check_reduce_op(op)
        tensors = [tensor] if isinstance(tensor, Tensor) else list(tensor)
        single = isinstance(tensor, Tensor)
        if self.world_size == 1:
            return completed_future(tensor if single else tensors)
        if op == "adasum":
            check_adasum_dtypes(tensors)  # here, not in the worker thread: before anything is posted
            if self.arrivals.on:
                self.arrivals.add("adasum", time.perf_counter_ns())
            return self._lanes.submit(self._adasum_job(tensors, single), self.backend.independent_tags)
        backend = self.backend
        if single:
            t = tensors[0]
            nbytes = self._all_reduce_bytes(t)
            return self._post(
                "all_reduce", nbytes, nbytes, lambda: backend.all_reduce(t, op, name), _describe(t, op)
            )
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        nbytes = self._all_reduce_bytes(flat)

        def _unflatten(f: Future) -> list[Tensor]:
            out = f.value()
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(out[offset : offset + n].view_as(t))
                offset += n
            return tensors

        detail = _describe(tensors, op)
        return self._post(
            "all_reduce", nbytes, nbytes, lambda: backend.all_reduce(flat, op, name), detail
        ).then(_unflatten)

    def all_reduce(self, tensor: TensorOrList, op: str = "sum") -> Any:
        fut = self.all_reduce_async(tensor, op)
        return self._wait(fut, "all_reduce", _describe(tensor, check_reduce_op(op)))

    def _adasum_job(self, tensors: list[Tensor], single: bool) -> Callable[[int], Any]:
        """Adasum of ``tensors`` as a job for a lane (called with its tag), on the caller's CUDA
        stream; its run is a busy interval, so overlapping lanes count once."""
        stream = torch.cuda.current_stream(tensors[0].device) if tensors and tensors[0].is_cuda else None

        def _job(tag: int) -> Any:
            self.stats.enter(time.perf_counter_ns())
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self._adasum(tensors, tag)
            finally:
                self.stats.leave(time.perf_counter_ns())
            return tensors[0] if single else tensors

        return _job

    def _adasum(self, tensors: list[Tensor], tag: int) -> None:
        """Adasum in place (the transport's own where it has one), counted under ``adasum``."""
        if not tensors:
            return
        detail = _describe(tensors, "adasum")
        with naming_timeouts("all_reduce", self._timeouts.append, detail=detail, **self.timeout_context()):
            start = time.perf_counter()
            moved = self.backend.native_adasum(tensors)
            sent, received = moved if moved is not None else adasum_all_reduce(self.backend, tensors, tag)
            self.count("adasum", sent, received, time.perf_counter() - start)

    # -- broadcast ----------------------------------------------------------------------------
    def broadcast_async(self, tensor: Tensor, src: int = 0) -> Future:
        if self.world_size == 1:
            return completed_future(tensor)
        n = _nbytes(tensor)
        sent, received = ((self.world_size - 1) * n, 0) if self.rank == src else (0, n)
        backend = self.backend
        detail = f"{_describe(tensor)} from rank {src}"
        return self._post("broadcast", sent, received, lambda: backend.broadcast(tensor, src), detail)

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        return self._wait(
            self.broadcast_async(tensor, src), "broadcast", f"{_describe(tensor)} from rank {src}"
        )

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Broadcast any picklable object from ``src``; counted as its pickled size plus 8 bytes."""
        if self.world_size == 1:
            return obj
        self._lanes.wait_idle()
        start = time.perf_counter_ns()
        context = self.timeout_context()
        detail = f"from rank {src}"
        with (
            self._blocking("broadcast_object", start, detail),
            naming_timeouts("broadcast_object", self._timeouts.append, detail=detail, **context),
        ):
            result = self.backend.broadcast_object(obj, src)
        n = len(pickle.dumps(result)) + 8
        sent, received = ((self.world_size - 1) * n, 0) if self.rank == src else (0, n)
        self.stats.add("broadcast_object", sent, received, (time.perf_counter_ns() - start) / 1e9)
        self.stats.add_busy((time.perf_counter_ns() - start) / 1e9)
        if _trace.active is not None:
            self._traced("broadcast_object", sent, received, start, f"from rank {src}")
        return result

    # -- all_gather ---------------------------------------------------------------------------
    def all_gather_async(self, tensor: Tensor) -> Future:
        """Gather from every rank, in rank order; every rank's ``tensor`` has the same shape (the
        caller's contract: unequal shapes go through the blocking ``all_gather``)."""
        w = self.world_size
        if w == 1:
            return completed_future([tensor.clone()])
        backend = self.backend
        n = (w - 1) * _nbytes(tensor)
        return self._post("all_gather", n, n, lambda: backend.all_gather(tensor), _describe(tensor))

    def all_gather_into_async(self, output: Tensor, tensor: Tensor) -> Future:
        """Gather every rank's ``tensor`` (equal shapes) into ``output``, W times its elements, rank
        after rank (FSDP2's all-gather of a parameter group); counted as ``all_gather``."""
        w = self.world_size
        if output.numel() != w * tensor.numel():
            raise ValueError(
                f"all_gather_into: output has {output.numel()} elements; it needs world size x input = "
                f"{w} x {tensor.numel()}"
            )
        if w == 1:
            output.copy_(tensor.reshape(output.shape))
            return completed_future(output)
        backend = self.backend
        n = (w - 1) * _nbytes(tensor)
        return self._post(
            "all_gather", n, n, lambda: backend.all_gather_into(output, tensor), _describe(tensor)
        )

    def all_gather_into(self, output: Tensor, tensor: Tensor) -> Tensor:
        fut = self.all_gather_into_async(output, tensor)
        return self._wait(fut, "all_gather", _describe(tensor))

    def all_gather(self, tensor: Tensor, same_shape: bool = False) -> list[Tensor]:
        """Gather from every rank, in rank order.

        Unequal first dimensions are allowed: the ranks first exchange their shapes (an
        ``all_gather`` call of its own in the counters), then gather the tensors padded to the
        longest. Other dimensions that differ raise a ``ValueError`` on every rank.
        ``same_shape=True`` promises equal shapes and skips the exchange.
        """
        if same_shape or self.world_size == 1:
            return self._wait(self.all_gather_async(tensor), "all_gather", _describe(tensor))
        w = self.world_size
        backend = self.backend
        shape = torch.tensor(list(tensor.shape), dtype=torch.int64)
        shape_bytes = (w - 1) * _nbytes(shape)
        detail = f"shape exchange before {_describe(tensor)}"
        fut = self._post(
            "all_gather",
            shape_bytes,
            shape_bytes,
            lambda: backend.all_gather(backend.to_transport_device(shape)),
            detail,
        )
        shapes = [s.cpu() for s in self._wait(fut, "all_gather", detail)]
        rest = tuple(tensor.shape[1:])
        for s in shapes:
            if tuple(s.tolist()[1:]) != rest:
                raise ValueError(
                    f"all_gather: tensors may differ only in their first dimension; got shapes "
                    f"{[tuple(x.tolist()) for x in shapes]}"
                )
        lengths = [int(s[0]) for s in shapes] if tensor.dim() > 0 else [1] * w
        longest = max(lengths)
        padded = tensor
        if tensor.dim() > 0 and tensor.shape[0] < longest:
            padded = torch.zeros((longest, *rest), dtype=tensor.dtype, device=tensor.device)
            padded[: tensor.shape[0]] = tensor
        n = (w - 1) * _nbytes(padded)
        fut = self._post("all_gather", n, n, lambda: backend.all_gather(padded), _describe(padded))
        gathered = self._wait(fut, "all_gather", _describe(padded))
        if tensor.dim() == 0:
            return gathered
        return [g[:length] for g, length in zip(gathered, lengths)]

    # -- reduce_scatter -----------------------------------------------------------------------
    def reduce_scatter_async(self, tensor: TensorOrList, op: str = "sum") -> Future:
        """Reduce over ranks and keep this rank's share: the r-th of W equal chunks along dim 0
        (or the r-th tensor of a list of W)."""
        op = check_reduce_op(op)
        if op == "adasum":
            raise ValueError("reduce_scatter: op='adasum' is not supported; accepted: sum, avg, min, max")
        w = self.world_size
        if isinstance(tensor, Tensor):
            if tensor.shape[0] % w != 0:
                raise ValueError(
                    f"reduce_scatter: first dimension {tensor.shape[0]} must divide by world size {w}; pad "
                    f"it to a multiple of {w}, or pass a list of {w} tensors (one per rank)"
                )
            inputs = list(tensor.chunk(w))
        else:
            inputs = list(tensor)
            if len(inputs) != w:
                raise ValueError(f"reduce_scatter: needs {w} input tensors (one per rank), got {len(inputs)}")
        if w == 1:
            return completed_future(inputs[0].clone())
        output = torch.empty_like(inputs[self.rank])
        inputs = [t.contiguous() for t in inputs]
        moved = (w - 1) * sum(_nbytes(t) for t in inputs) // w
        backend = self.backend
        detail = _describe(tensor, op)
        return self._post(
            "reduce_scatter", moved, moved, lambda: backend.reduce_scatter(output, inputs, op), detail
        )

    def reduce_scatter(self, tensor: TensorOrList, op: str = "sum") -> Tensor:
        fut = self.reduce_scatter_async(tensor, op)
        return self._wait(fut, "reduce_scatter", _describe(tensor, check_reduce_op(op)))

    # -- all_to_all ---------------------------------------------------------------------------
    def _check_all_to_all(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        if len(inputs) != self.world_size:
            raise ValueError(
                f"all_to_all: needs {self.world_size} input tensors (one per rank), got {len(inputs)}"
            )
        return [t.contiguous() for t in inputs]

    def all_to_all_async(self, inputs: Sequence[Tensor], output_rows: Sequence[int]) -> Future:
        """Send ``inputs[j]`` to rank j; returns what each rank sent here, in rank order.

        ``output_rows[j]``: the first dimension of what rank j sends here (the caller's contract;
        row counts this rank does not know go through the blocking ``all_to_all``). Trailing
        dimensions are those of ``inputs``; a 0-d chunk counts as one row.
        """
        inputs = self._check_all_to_all(inputs)
        w = self.world_size
        if len(output_rows) != w:
            raise ValueError(
                f"all_to_all: output_rows needs {w} row counts (one per rank), got {len(output_rows)}"
            )
        if w == 1:
            return completed_future([inputs[0].clone()])
        backend = self.backend
        rank = self.rank
        ref = inputs[rank]
        rest = tuple(ref.shape[1:])
        outputs = [
            torch.empty((n, *rest) if ref.dim() else (), dtype=ref.dtype, device=ref.device)
            for n in output_rows
        ]
        sent = sum(_nbytes(t) for j, t in enumerate(inputs) if j != rank)
        received = sum(_nbytes(t) for j, t in enumerate(outputs) if j != rank)
        return self._post(
            "all_to_all", sent, received, lambda: backend.all_to_all(outputs, inputs), _describe(inputs)
        )

    def all_to_all(
        self, inputs: Sequence[Tensor], output_rows: Optional[Sequence[int]] = None
    ) -> list[Tensor]:
        """``all_to_all_async`` and wait. Without ``output_rows`` the ranks first exchange their row
        counts (int64; an ``all_to_all`` call of its own in the counters), so first dimensions may
        differ freely."""
        inputs = self._check_all_to_all(inputs)
        w = self.world_size
        detail = _describe(inputs)
        if output_rows is None and w > 1:
            backend = self.backend
            send_len = [
                backend.to_transport_device(torch.tensor([rows(t)], dtype=torch.int64)) for t in inputs
            ]
            recv_len = [backend.to_transport_device(torch.empty(1, dtype=torch.int64)) for _ in range(w)]
            counts = f"row-count exchange before {detail}"
            fut = self._post(
                "all_to_all", (w - 1) * 8, (w - 1) * 8, lambda: backend.all_to_all(recv_len, send_len), counts
            )
            output_rows = [int(n.item()) for n in self._wait(fut, "all_to_all", counts)]
        fut = self.all_to_all_async(inputs, [1] * w if output_rows is None else output_rows)
        return self._wait(fut, "all_to_all", detail)

    # -- point to point and barrier ---------------------------------------------------------------
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        backend = self.backend
        detail = f"{_describe(tensor)} to rank {dst}, tag {tag}"
        return self._post("send", _nbytes(tensor), 0, lambda: backend.send(tensor, dst, tag), detail)

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        backend = self.backend
        detail = f"{_describe(tensor)} from rank {src}, tag {tag}"
        return self._post("recv", 0, _nbytes(tensor), lambda: backend.recv(tensor, src, tag), detail)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        self._lanes.wait_idle()
        start = time.perf_counter_ns()
        with (
            self._blocking("barrier", start),
            naming_timeouts("barrier", self._timeouts.append, **self.timeout_context()),
        ):
            self.backend.barrier()
        self.stats.add("barrier", 0, 0, (time.perf_counter_ns() - start) / 1e9)
        self.stats.add_busy((time.perf_counter_ns() - start) / 1e9)
        if _trace.active is not None:
            self._traced("barrier", 0, 0, start)
