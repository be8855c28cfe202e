"""``Communicator``: the collectives API over one backend, with byte/time accounting on every call.

Wire model for the byte counters (per rank, N = payload bytes, W = world size):
  all_reduce      what the backend reports (``Backend.all_reduce_bytes``); a ring by default:
                  sends and receives 2*(W-1)*N // W
  broadcast       the source sends (W-1)*N, every other rank receives N
  all_gather      sends (W-1)*N_own, receives the sum of the others' N (uneven: padded sizes, plus
                  the int64 shape exchange)
  reduce_scatter  sends and receives (W-1)*N // W of its N-byte input
  all_to_all      sends the chunks addressed to other ranks, receives the chunks from them (plus
                  the int64 row-count exchange)
  adasum          what the recursive halving/doubling exchange really sends (see adasum.py)
At world size 1 every count is zero. Seconds run from posting an operation to its completion.

Tracing (``collectives.trace``): while a recorder is active, every operation is also recorded with
its op, bytes, posting and completion times and posting thread; off, it costs one ``None`` check.

Ranks must post collectives in the same order. Two calls post their data exchange from a callback,
once a shape exchange has completed (``all_gather`` of unequal shapes, ``all_to_all``); later calls
on the same communicator are held back until then, so every rank still posts in call order.
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
from lightning_dist.collectives.adasum import (
    ADASUM_LANES,
    ADASUM_TAG,
    adasum_all_reduce,
    check_adasum_dtypes,
)
from lightning_dist.collectives.backend import Backend, check_reduce_op, rows
from lightning_dist.collectives.completer import Completer
from lightning_dist.collectives.futures import completed_future, forward
from lightning_dist.collectives.timeouts import naming_timeouts

logger = logging.getLogger(__name__)

TensorOrList = Union[Tensor, Sequence[Tensor]]


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


def _settled(fut: Future) -> Future:
    """``fut`` once it has completed, with a value or an exception."""
    with contextlib.suppress(BaseException):  # read by the caller through fut.value()
        fut.wait()
    return fut


class _PostOrder:
    """Posts backend operations in call order: while a two-stage call waits to post its second
    stage, later calls are held back in a queue and posted, in order, once it has.

    A second stage whose first has not completed yet is posted (with the calls held behind it) from
    a ``Completer`` thread of this object, never from a transport's own thread: a callback there
    that held the last reference to a process group would run the group's destructor inside the
    group's worker thread, which aborts the process.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: deque[tuple[Callable[[], None], bool]] = deque()  # (post it, is two-stage)
        self._blocked = False  # a second stage is still to be posted
        self._draining = False
        self._poster = Completer("collectives-poster")
        self._workers = [Completer(f"collectives-exclusive-{i}") for i in range(ADASUM_LANES)]
        self._running = 0  # exclusive calls handed to a worker and not yet returned

    def _busy(self) -> bool:
        return self._blocked or self._draining or bool(self._held)

    def post(self, start: Callable[[], Future]) -> Future:
        """``start()`` (which posts) now, or once every earlier call has posted."""
        out: Future = Future()

        def _run() -> None:
            try:
                fut = start()
            except BaseException as exc:  # noqa: BLE001  (delivered through the returned future)
                out.set_exception(exc)
            else:
                forward(fut, out)

        with self._cond:
            if self._busy():
                self._held.append((_run, False))
                return out
        return start()

    def post_two_stage(self, first: Callable[[], Future], second: Callable[[Any], Future]) -> Future:
        """``first()`` as ``post`` does, then ``second(first's value)`` once that completes; later
        calls are held back until ``second`` has posted (or either failed)."""
        out: Future = Future()

        # Later calls are released before the result is delivered, so that its callbacks find
        # them posted.
        def _second(head: Future) -> None:
            try:
                fut = second(head.value())
            except BaseException as exc:  # noqa: BLE001  (delivered through the returned future)
                self._unblock()
                out.set_exception(exc)
                return
            self._unblock()
            forward(fut, out)

        def _run() -> None:  # called with self._blocked set
            try:
                head = first()
            except BaseException as exc:  # noqa: BLE001  (delivered through the returned future)
                self._unblock()
                out.set_exception(exc)
                return
            if head.done():  # NCCL's futures complete when the work is queued: post from here
                _second(_settled(head))
            else:
                self._poster.submit(lambda: _settled(head), _second)

        self._run_blocking(_run)
        return out

    def post_exclusive(self, run: Callable[[], Any], lane: int = 0, overlapping: bool = False) -> Future:
        """``run()`` on worker ``lane`` once every earlier call has posted, with later calls held back
        until it returns: a caller-driven exchange (Adasum's point-to-point rounds) runs alongside
        the caller (backward, say) while every rank still posts in call order.

        ``overlapping``: it may also start while earlier overlapping calls are still running, so
        that consecutive exchanges share the link (Gloo, one tag per lane); a lane runs its calls one
        after another, and later calls of other kinds still wait for all of them."""
        out: Future = Future()

        def _job() -> Any:
            try:
                return run()
            finally:
                with self._cond:
                    self._running -= 1
                    last = self._running == 0
                if last:
                    self._unblock()  # later calls are posted before the result is delivered

        def _submit() -> None:
            forward(self._workers[lane].submit(_job, lambda value: value), out)

        def _run() -> None:  # called with self._blocked set
            with self._cond:
                self._running += 1
            _submit()

        with self._cond:
            joins = overlapping and self._running > 0 and not self._held and not self._draining
            if joins:  # earlier exclusive calls (all overlapping: one backend) block the rest
                self._running += 1
        if joins:
            _submit()
        else:
            self._run_blocking(_run)
        return out

    def _run_blocking(self, run: Callable[[], None]) -> None:
        """``run()`` now with later calls held back (it unblocks them), or queued behind earlier ones."""
        with self._cond:
            if self._busy():
                self._held.append((run, True))
                return
            self._blocked = True
        run()

    def _unblock(self) -> None:
        """Post held-back calls in order until one blocks again; one drain loop at a time."""
        with self._cond:
            self._blocked = False
            if self._draining:
                return  # the drain loop already running (this thread or another) carries on
            self._draining = True
        while True:
            with self._cond:
                if self._blocked or not self._held:
                    self._draining = False
                    self._cond.notify_all()
                    return
                run, self._blocked = self._held.popleft()
            run()

    def wait(self) -> None:
        """Block until every earlier call has posted (before a blocking operation)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._busy())

    def close(self) -> None:
        """Stop this object's helper threads once their work is done (they restart on demand)."""
        for completer in (self._poster, *self._workers):
            completer.stop()


class Communicator:
    """All collectives over one ``Backend``; counts bytes and seconds into ``stats``.

    ``stats``: the counters this communicator adds to; its own new ``CommStats`` by default (pass one
    to share counters between communicators). ``close()`` stops the helper threads of this
    communicator and of its backend, and no other; they restart if it is used again."""

    def __init__(self, backend: Backend, stats: Optional[CommStats] = None) -> None:
        self.backend = backend
        self.stats = CommStats() if stats is None else stats
        self._order = _PostOrder()
        self._adasum_calls = 0

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
        self._order.close()
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
        """``fut.wait()``, a timeout raised as ``CollectiveTimeout`` (torch re-wraps an exception
        raised in a future callback as a plain ``RuntimeError``; this gives blocking calls the type)."""
        with naming_timeouts(op, detail=detail, **self.timeout_context()):
            return fut.wait()

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
        stats.enter(begin)
        try:
            fut = start()
        except BaseException:
            stats.leave(time.perf_counter_ns())
            raise
        stats.add(op, sent, received)
        context = self.timeout_context()
        if rec is not None:
            rank, world_size, thread = self.rank, self.world_size, threading.current_thread().name

        # The callback must not hold the communicator: if it dropped the last reference to a
        # process group inside that group's own worker thread, the group's destructor would abort.
        def _done(f: Future) -> Any:
            end = time.perf_counter_ns()
            stats.add_time(op, (end - begin) / 1e9)
            stats.leave(end)
            if rec is not None:
                rec.collective(op, begin, end, sent, received, rank, world_size, thread, detail)
            with naming_timeouts(op, detail=detail, **context):
                return f.value()

        return fut.then(_done)

    def _traced(self, op: str, sent: int, received: int, begin_ns: int, detail: str = "") -> None:
        """Trace a blocking or caller-driven operation that ran from ``begin_ns`` until now."""
        rec = _trace.active
        if rec is not None:
            rec.collective(
                op, begin_ns, time.perf_counter_ns(), sent, received, self.rank, self.world_size, None, detail
            )

    def _post(
        self, op: str, sent: int, received: int, start: Callable[[], Future], detail: str = ""
    ) -> Future:
        """Post ``start()`` in call order and account for it."""
        return self._order.post(lambda: self._timed(op, sent, received, start, detail))

    def count(self, op: str, sent: int, received: int, seconds: float = 0.0) -> None:
        """Add bytes moved by a caller-driven exchange (compound algorithms such as Adasum)."""
        if self.world_size > 1:
            self.stats.add(op, sent, received, seconds)
            self.stats.add_busy(seconds)
            if _trace.active is not None:
                self._traced(op, sent, received, time.perf_counter_ns() - int(seconds * 1e9))

    def _all_reduce_bytes(self, t: Tensor) -> int:
        return self.backend.all_reduce_bytes(_nbytes(t), t.dtype)

    @contextlib.contextmanager
    def completions_held(self) -> Iterator[None]:
        """Operations posted in the block complete once it ends (at most ``HOLD_MAX_S`` later),
        not while it runs, where the transport's wait costs CPU (Horovod: see ``Completer.hold``).
        A strategy holds them during backward, as Horovod's optimizer only waits after it."""
        self.backend.hold_completions()
        try:
            yield
        finally:
            self.backend.release_completions()

    # -- all_reduce -------------------------------------------------------------------------
    def all_reduce_async(self, tensor: TensorOrList, op: str = "sum", name: Optional[str] = None) -> Future:
        """Reduce in place; a list is reduced as one fused buffer (Adasum: per tensor). ``name``
        (the same on every rank and step for the same tensor) goes to the backend (``Backend.all_reduce``).

        Adasum's exchange runs on a worker thread of this communicator, so the returned future is
        pending while it runs (a DDP bucket's Adasum overlaps the rest of backward); calls made
        meanwhile are posted after it, in call order, except that where the backend keeps tags apart
        the next Adasum may start at once, in the other lane (``ADASUM_LANES``)."""
        op = check_reduce_op(op)
        tensors = [tensor] if isinstance(tensor, Tensor) else list(tensor)
        single = isinstance(tensor, Tensor)
        if self.world_size == 1:
            return completed_future(tensor if single else tensors)
        if op == "adasum":
            check_adasum_dtypes(tensors)  # here, not in the worker thread: before anything is posted
            lane = self._adasum_calls % ADASUM_LANES  # call order is the same on every rank
            self._adasum_calls += 1
            overlapping = self.backend.independent_tags
            job = self._adasum_job(tensors, single, ADASUM_TAG + lane if overlapping else ADASUM_TAG)
            return self._order.post_exclusive(job, lane if overlapping else 0, overlapping)
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

    def _adasum_job(self, tensors: list[Tensor], single: bool, tag: int) -> Callable[[], Any]:
        """Adasum of ``tensors`` as a job for another thread, on the caller's CUDA stream, its
        messages on ``tag``; its run is a busy interval, so overlapping lanes count once."""
        stream = torch.cuda.current_stream(tensors[0].device) if tensors and tensors[0].is_cuda else None

        def _job() -> Any:
            self.stats.enter(time.perf_counter_ns())
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    reduced = self._adasum(tensors, tag)
            finally:
                self.stats.leave(time.perf_counter_ns())
            return reduced[0] if single else reduced

        return _job

    def _adasum(self, tensors: list[Tensor], tag: int = ADASUM_TAG) -> list[Tensor]:
        with naming_timeouts("all_reduce", detail=_describe(tensors, "adasum"), **self.timeout_context()):
            native = self.backend.native_adasum(self, tensors)
            return native if native is not None else adasum_all_reduce(self, tensors, tag)

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
        self._order.wait()
        start = time.perf_counter_ns()
        with naming_timeouts("broadcast_object", detail=f"from rank {src}", **self.timeout_context()):
            result = self.backend.broadcast_object(obj, src)
        n = len(pickle.dumps(result)) + 8
        sent, received = ((self.world_size - 1) * n, 0) if self.rank == src else (0, n)
        self.stats.add("broadcast_object", sent, received, (time.perf_counter_ns() - start) / 1e9)
        self.stats.add_busy((time.perf_counter_ns() - start) / 1e9)
        if _trace.active is not None:
            self._traced("broadcast_object", sent, received, start, f"from rank {src}")
        return result

    # -- all_gather ---------------------------------------------------------------------------
    def all_gather_async(self, tensor: Tensor, same_shape: bool = False) -> Future:
        """Gather from every rank, in rank order.

        Unequal first dimensions are allowed: the ranks first exchange their shapes, then gather
        the tensors padded to the longest. That shape exchange is an ``all_gather`` call of its own
        in the counters (its bytes and seconds); the data exchange is posted from its completion,
        so this never blocks. Other dimensions that differ fail the future with a ``ValueError``
        on every rank. ``same_shape=True`` promises equal shapes and skips the exchange.
        """
        w = self.world_size
        if w == 1:
            return completed_future([tensor.clone()])
        backend = self.backend
        if same_shape:
            n = (w - 1) * _nbytes(tensor)
            return self._post("all_gather", n, n, lambda: backend.all_gather(tensor), _describe(tensor))
        shape = torch.tensor(list(tensor.shape), dtype=torch.int64)
        shape_bytes = (w - 1) * _nbytes(shape)
        rest = tuple(tensor.shape[1:])

        def _gather_padded(gathered: list[Tensor]) -> Future:
            shapes = [s.cpu() for s in gathered]
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
            fut = self._timed("all_gather", n, n, lambda: backend.all_gather(padded), _describe(padded))
            if tensor.dim() == 0:
                return fut
            return fut.then(lambda f: [g[:length] for g, length in zip(f.value(), lengths)])

        return self._order.post_two_stage(
            lambda: self._timed(
                "all_gather",
                shape_bytes,
                shape_bytes,
                lambda: backend.all_gather(backend.to_transport_device(shape)),
                f"shape exchange before {_describe(tensor)}",
            ),
            _gather_padded,
        )

    def all_gather(self, tensor: Tensor, same_shape: bool = False) -> list[Tensor]:
        return self._wait(self.all_gather_async(tensor, same_shape), "all_gather", _describe(tensor))

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
    def all_to_all_async(self, inputs: Sequence[Tensor]) -> Future:
        """Send ``inputs[j]`` to rank j; returns what each rank sent here, in rank order.

        First dimensions may differ: the ranks first exchange their row counts (int64), counted as
        an ``all_to_all`` call of its own (its bytes and seconds); the data exchange is posted from
        its completion, so this never blocks.
        """
        w = self.world_size
        inputs = [t.contiguous() for t in inputs]
        if len(inputs) != w:
            raise ValueError(f"all_to_all: needs {w} input tensors (one per rank), got {len(inputs)}")
        if w == 1:
            return completed_future([inputs[0].clone()])
        backend = self.backend
        rank = self.rank
        lengths = torch.tensor([rows(t) for t in inputs], dtype=torch.int64)
        send_len = [backend.to_transport_device(x.reshape(1)) for x in lengths]
        recv_len = [backend.to_transport_device(torch.empty(1, dtype=torch.int64)) for _ in range(w)]
        ref = inputs[rank]
        rest = tuple(ref.shape[1:])
        detail = _describe(inputs)

        def _exchange(received_len: list[Tensor]) -> Future:
            rows = [int(n.item()) for n in received_len]
            outputs = [
                torch.empty((n, *rest) if ref.dim() else (), dtype=ref.dtype, device=ref.device) for n in rows
            ]
            sent = sum(_nbytes(t) for j, t in enumerate(inputs) if j != rank)
            received = sum(_nbytes(t) for j, t in enumerate(outputs) if j != rank)
            return self._timed(
                "all_to_all", sent, received, lambda: backend.all_to_all(outputs, inputs), detail
            )

        return self._order.post_two_stage(
            lambda: self._timed(
                "all_to_all",
                (w - 1) * 8,
                (w - 1) * 8,
                lambda: backend.all_to_all(recv_len, send_len),
                f"row-count exchange before {detail}",
            ),
            _exchange,
        )

    def all_to_all(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        return self._wait(self.all_to_all_async(inputs), "all_to_all", _describe(list(inputs)))

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
        self._order.wait()
        start = time.perf_counter_ns()
        with naming_timeouts("barrier", **self.timeout_context()):
            self.backend.barrier()
        self.stats.add("barrier", 0, 0, (time.perf_counter_ns() - start) / 1e9)
        self.stats.add_busy((time.perf_counter_ns() - start) / 1e9)
        if _trace.active is not None:
            self._traced("barrier", 0, 0, start)
