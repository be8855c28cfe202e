"""The helper thread that completes futures of blocking waits: FIFO order, errors, and ``hold``."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_dist.collectives import completer as completer_mod
from lightning_dist.collectives.completer import Completer


def test_futures_complete_in_submission_order_with_errors_delivered() -> None:
    done: list[int] = []
    c = Completer("test-completer")
    futs = [c.submit(lambda i=i: done.append(i) or i, lambda v: v * 10) for i in range(5)]
    boom = c.submit(lambda: 1 / 0, lambda v: v)
    assert [f.wait() for f in futs] == [0, 10, 20, 30, 40]
    assert done == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError):
        boom.wait()
    c.stop()


def test_hold_delays_the_waits_until_release() -> None:
    started = threading.Event()
    c = Completer("test-completer")
    c.hold()
    fut = c.submit(lambda: started.set() or "ok", lambda v: v)
    assert not started.wait(0.3), "a held completer must not start waiting"
    assert not fut.done()
    c.release()
    assert fut.wait() == "ok" and started.is_set()
    later = c.submit(lambda: "again", lambda v: v)  # released: no delay
    assert later.wait() == "again"
    c.stop()


def test_a_forgotten_hold_delays_by_at_most_hold_max_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(completer_mod, "HOLD_MAX_S", 0.2)
    c = Completer("test-completer")
    c.hold()
    start = time.perf_counter()
    assert c.submit(lambda: 7, lambda v: v).wait() == 7
    assert 0.15 < time.perf_counter() - start < 5.0
    c.release()
    c.stop()
