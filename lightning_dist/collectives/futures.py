"""Small helpers for ``torch.futures.Future``: completed and failed futures, and chaining.

``chain`` starts a second asynchronous operation when a first one completes and returns one future
for the pair, without ever blocking: a callback that called ``.wait()`` on another transport
operation could stall the very thread that has to complete it (NCCL's and Horovod's completion
threads, a Gloo worker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch.futures import Future


def completed_future(value: Any) -> Future:
    """A future that already holds ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def failed_future(exc: BaseException) -> Future:
    """A future that already holds the exception ``exc``."""
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


def forward(source: Future, target: Future) -> None:
    """Complete ``target`` with ``source``'s value or exception once ``source`` completes."""

    def _copy(done: Future) -> None:
        try:
            value = done.value()
        except BaseException as exc:  # noqa: BLE001  (delivered through the target future)
            target.set_exception(exc)
        else:
            target.set_result(value)

    source.add_done_callback(_copy)


def chain(first: Future, then: Callable[[Any], Future], result: Optional[Future] = None) -> Future:
    """A future for ``then(first's value)``, itself a future: starts the second operation from
    ``first``'s completion callback and completes when it does. An exception in either (or in
    ``then``) ends up in the returned future. ``result`` lets a caller supply the future to complete
    (one made with ``devices=`` for CUDA streams, say)."""
    out: Future = Future() if result is None else result

    def _start(done: Future) -> None:
        try:
            second = then(done.value())
        except BaseException as exc:  # noqa: BLE001  (delivered through the returned future)
            out.set_exception(exc)
            return
        forward(second, out)

    first.add_done_callback(_start)
    return out
