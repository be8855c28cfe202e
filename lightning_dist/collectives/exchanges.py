"""The one driver that maps a compressor's ``Exchange`` rounds to collectives.

A compressor (``lightning_dist.compression``) never talks to a transport: each ``Exchange`` yields
rounds (a payload and how it is aggregated) and takes their aggregates back. ``run_exchanges`` runs
the rounds of a sequence of exchange groups over a transport (``AsyncCollectives``: a
``Communicator`` is one), one collective per round, in one fixed order (group by group, round by
round), so every rank issues the same collectives in the same order. It never blocks: each round is
started from the completion callback of the one before, so it is safe inside DDP comm hooks and
transport completion threads; a round's shapes are the same on every rank by the exchange's
contract, so every round is one asynchronous collective (no shape exchange). The DDP compressed
hook, ``Horovod(compression=...)`` and the tests all drive compressors through it.

A *group* is one exchange, or several exchanges in lockstep whose all-reduce rounds travel as one
fused all-reduce (Adasum per tensor in the compressed hook).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import torch
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives.backend import rows

if TYPE_CHECKING:
    from lightning_dist.compression import Exchange

Group = Sequence["Exchange"]


class AsyncCollectives(Protocol):
    """The asynchronous collectives the driver posts (``Communicator`` has them): each posts at once,
    in call order, and accounts for itself."""

    def all_reduce_async(
        self, tensor: Union[Tensor, Sequence[Tensor]], op: str = "sum", name: Optional[str] = None
    ) -> Future: ...

    def all_gather_async(self, tensor: Tensor) -> Future: ...

    def all_to_all_async(self, inputs: Sequence[Tensor], output_rows: Sequence[int]) -> Future: ...


def start_round(comm: AsyncCollectives, group: Group, all_reduce_op: Optional[str] = None) -> Future:
    """Start the collective of ``group``'s current round; the future holds what ``feed`` takes.

    ``all_reduce_op`` replaces the op of all-reduce rounds (Horovod averages exchanges that were
    started for world size 1)."""
    rounds = [ex.round for ex in group]
    first = rounds[0]
    if first is None:
        raise RuntimeError(
            "start_round: the group's first exchange is finished (its round is None); start a round only "
            "while exchange.round is not None and read exchange.result once it is (run_exchanges does both)"
        )
    op = all_reduce_op or first.op
    if len(rounds) > 1:
        if any(r is None or r.kind != "allreduce" or r.op != first.op for r in rounds):
            kinds = [None if r is None else f"{r.kind}/{r.op}" for r in rounds]
            raise RuntimeError(
                f"run_exchanges: a lockstep group fuses all-reduce rounds of one op, but its exchanges' "
                f"rounds are {kinds}; put exchanges whose rounds differ in groups of their own"
            )
        return comm.all_reduce_async([r.payload for r in rounds if r is not None], op)
    if first.kind == "allreduce":
        return comm.all_reduce_async(first.payload, op)
    if first.kind == "allgather":
        return comm.all_gather_async(first.payload)  # equal shapes on every rank: the round's contract
    chunks = list(first.payload.unbind(0))  # row j to rank j; every rank's rows have one shape
    return comm.all_to_all_async(chunks, [rows(chunks[0])] * len(chunks))


def same_threads_as_caller(threads: int) -> None:
    """Give this (transport callback) thread the caller's CPU thread count before it computes a
    round: torch keeps MKL's count per thread, and a GEMM (PowerSGD's) split over another number of
    threads rounds differently, so ranks whose rounds run on different threads would drift apart."""
    torch.set_num_threads(threads)


def feed(group: Group, received: Any) -> None:
    """Hand a round's aggregate to the group's exchange(s)."""
    if len(group) == 1:
        group[0].feed(received)
    else:
        for ex, value in zip(group, received, strict=True):
            ex.feed(value)


class _Driver:
    """Walks the groups' rounds from completion callbacks; completes ``done`` with None at the end."""

    def __init__(
        self, comm: AsyncCollectives, groups: Sequence[Group], op: Optional[str], done: Future
    ) -> None:
        self.comm: Optional[AsyncCollectives] = comm
        self.groups = deque(list(g) for g in groups if g and g[0].round is not None)
        self.op = op
        self.done = done
        self.threads = torch.get_num_threads()

    def _finish(self, exc: Optional[BaseException] = None) -> None:
        # Let go of the communicator before completing: the last reference to a process group must
        # not die in that group's own worker thread (its destructor would join itself and abort).
        self.comm = None
        self.groups.clear()
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)

    def start(self, inflight: Optional[Future]) -> None:
        if inflight is None:
            self._advance()
        else:
            inflight.add_done_callback(self._landed)

    def _landed(self, fut: Future) -> None:
        try:
            same_threads_as_caller(self.threads)
            feed(self.groups[0], fut.value())
        except BaseException as exc:  # noqa: BLE001  (delivered through the done future)
            self._finish(exc)
            return
        self._advance()

    def _advance(self) -> None:
        """Start rounds until one is in flight; rounds that complete at once are fed in this loop."""
        try:
            while True:
                while self.groups and self.groups[0][0].round is None:
                    self.groups.popleft()
                if not self.groups:
                    self._finish()
                    return
                assert self.comm is not None
                fut = start_round(self.comm, self.groups[0], self.op)
                if not fut.done():
                    fut.add_done_callback(self._landed)
                    return
                feed(self.groups[0], fut.value())
        except BaseException as exc:  # noqa: BLE001  (delivered through the done future)
            self._finish(exc)


def run_exchanges(
    comm: AsyncCollectives,
    groups: Sequence[Group],
    *,
    after: Optional[Future] = None,
    inflight: Optional[Future] = None,
    all_reduce_op: Optional[str] = None,
    done: Optional[Future] = None,
) -> Future:
    """Run every round of every group, in order; the returned future completes (with None) when
    every exchange has its ``result``, or holds the first error.

    Args:
        after: start only once this future completes (serialises calls: pass the previous call's
            future so later rounds of different calls cannot interleave differently on different ranks).
        inflight: the future of the first group's current round, when the caller already started it
            with ``start_round`` (to get the first collective going before the previous call ends).
        all_reduce_op: see ``start_round``.
        done: the future to complete (e.g. one made with ``devices=`` for CUDA stream semantics).
    """
    out: Future = Future() if done is None else done
    driver = _Driver(comm, groups, all_reduce_op, out)
    if after is None:
        driver.start(inflight)
        return out

    def _go(prev: Future) -> None:
        try:
            prev.value()
        except BaseException as exc:  # noqa: BLE001  (delivered through the returned future)
            out.set_exception(exc)
            return
        driver.start(inflight)

    after.add_done_callback(_go)
    return out
