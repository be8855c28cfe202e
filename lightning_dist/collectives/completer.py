"""One helper thread that waits on blocking handles in submission order and completes futures.

For transport operations that give no future of their own (Gloo's send/recv, Horovod's handles).
The transport has already posted the operation when it is submitted, so waiting in FIFO order
cannot deadlock. The thread exits after ``IDLE_S`` seconds without work and is restarted on demand,
so a backend that is no longer used leaves no thread behind.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

from torch.futures import Future

logger = logging.getLogger(__name__)

IDLE_S = 1.0
"""Seconds without work after which the thread exits."""

HOLD_MAX_S = 2.0
"""Longest a ``hold`` delays the waits: a caller that blocks on a future while it holds is
late by at most this, never stuck."""

_STOP = object()
_LIVE: weakref.WeakSet[Completer] = weakref.WeakSet()


@atexit.register
def stop_all() -> None:
    """Stop every completer thread (they restart on demand). Strategies call it at teardown and it
    runs at exit: a daemon thread woken during interpreter finalisation is ended from inside native
    code, which aborts the process ("terminate called without an active exception")."""
    for completer in list(_LIVE):
        completer.stop()


class Completer:
    """Completes each submitted future with ``finish(wait())``, one submission after another."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._go.set()
        _LIVE.add(self)

    def hold(self) -> None:
        """Do not start waiting on submitted work until ``release`` (or ``HOLD_MAX_S``): for a
        transport whose wait costs CPU, while the caller computes (Horovod's wait polls and retakes
        the GIL in a loop; its own optimizer only waits after backward)."""
        self._go.clear()

    def release(self) -> None:
        """Wait on submitted work again, from now on."""
        self._go.set()

    def is_current(self) -> bool:
        """Whether the calling thread is this completer's (a callback of one of its futures)."""
        return self._thread is threading.current_thread()

    @property
    def running(self) -> bool:
        """Whether its thread is alive now (it exits after ``IDLE_S`` without work, or at ``stop``)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread once the work already submitted is done (a later ``submit`` restarts it)."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._pending.put(_STOP)
        thread.join(timeout)

    def submit(self, wait: Callable[[], Any], finish: Callable[[Any], Any]) -> Future:
        """A future for ``finish(wait())``; an exception in either ends up in the future."""
        fut: Future = Future()
        with self._lock:
            self._pending.put((wait, finish, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
                logger.debug("%s: thread started", self.name)
        return fut

    def _loop(self) -> None:
        while True:
            try:
                item = self._pending.get(timeout=IDLE_S)
            except queue.Empty:
                item = None
            if item is None or item is _STOP:
                with self._lock:
                    if self._pending.empty():  # submit() puts under the lock, so nothing is missed
                        self._thread = None
                        logger.debug("%s: %s, thread exits", self.name, "idle" if item is None else "stopped")
                        return
                continue
            wait, finish, fut = item
            self._go.wait(HOLD_MAX_S)
            try:
                result = finish(wait())
            except BaseException as exc:  # noqa: BLE001  (delivered through the future)
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            del wait, finish, fut  # hold nothing (a work, a tensor) while idle
