"""FaultTolerant's failure detection and its log: the timeouts derived from ``peer_timeout_s``
(pure) and printed once; the causes read from a failed step's error; the event lines a sequence of
quorums, failures and heals makes (pure, a fake clock); and one in-process fit printing its
timeouts. The kill and SIGSTOP runs that check the lines end to end share the launches of
tests/test_fault_tolerant.py (``test_a_kill_and_a_stop_each_give_one_line_per_event``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lightning_dist.collectives.fault_tolerant_events import RecoveryEvents, failure_cause, size_text
from lightning_dist.collectives.fault_tolerant_timeouts import derive_timeouts


# -- the one timeout -----------------------------------------------------------------------------------
def test_default_peer_timeout_gives_todays_timeouts() -> None:
    """``peer_timeout_s=60`` (the default) with nothing overridden: every figure as before the option
    (60 s collectives, step, quorum and start-up; 2 x 60 + 60 inside a group)."""
    t = derive_timeouts(60.0)
    assert (t.collective_s, t.step_s, t.quorum_s, t.startup_s, t.group_s) == (60, 60, 60, 60, 180)
    assert t.overridden == ()


def test_each_timeout_follows_the_one_figure_and_an_override_replaces_only_its_own() -> None:
    t = derive_timeouts(5.0)
    assert (t.collective_s, t.step_s, t.quorum_s, t.startup_s, t.group_s) == (5, 5, 5, 5, 15)
    t = derive_timeouts(5.0, timeout_s=2.0)
    assert (t.collective_s, t.step_s, t.quorum_s, t.startup_s, t.group_s) == (2, 2, 5, 2, 9)
    assert t.overridden == ("timeout_s",)
    t = derive_timeouts(5.0, quorum_timeout_s=30.0)
    assert (t.collective_s, t.quorum_s, t.group_s) == (5, 30, 40)
    assert "peer_timeout_s=5 (quorum_timeout_s given): collectives 5 s" in t.line()


def test_strategy_options_resolve_the_timeouts() -> None:
    from lightning_dist import FaultTolerant, FaultTolerantDiLoCo

    default = FaultTolerant().options
    assert (default.peer_timeout_s, default.timeout_s, default.quorum_timeout_s) == (60, 60, 60)
    options = FaultTolerant(peer_timeout_s=8).options
    assert (options.timeout_s, options.quorum_timeout_s, options.timeouts.group_s) == (8, 8, 24)
    options = FaultTolerant(peer_timeout_s=8, timeout_s=3).options  # today's option still works
    assert (options.timeout_s, options.quorum_timeout_s) == (3, 8)
    assert FaultTolerantDiLoCo(inner_steps=2, peer_timeout_s=9).options.quorum_timeout_s == 9
    for bad in ({"peer_timeout_s": 0}, {"peer_timeout_s": -1.0}, {"quorum_timeout_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FaultTolerant(**bad)


def test_the_timeouts_line_is_printed_once_per_group_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A one-group fit in this process logs the derived timeouts once, from the pack's logger."""
    from test_fault_tolerant import _fit_alone

    from lightning_dist.launch.fault_tolerant import Lighthouse

    caplog.set_level(logging.INFO)
    with Lighthouse("127.0.0.1:0") as lighthouse:
        _fit_alone(tmp_path, lighthouse.address, peer_timeout_s=7)
    lines = [r for r in caplog.records if "timeouts from peer_timeout_s" in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "lightning_dist.fault_tolerant"
    assert (
        lines[0]
        .getMessage()
        .startswith(
            "FaultTolerant: timeouts from peer_timeout_s=7: collectives 7 s, step 7 s, quorum 7 s, start-up 7 s"
        )
    )


# -- causes and lines ------------------------------------------------------------------------------------
class _Wrapped(Exception):
    """torchft's ExceptionWithTraceback: the error the Manager recorded, with its traceback."""

    def __init__(self, e: Exception) -> None:
        super().__init__(f"{e}\nTraceback ...")
        self.original_exception = e


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30641"), "process exit"),
        (_Wrapped(RuntimeError("[pair.cc:598] Connection reset by peer")), "process exit"),
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"), "no answer within 10 s"),
        (_Wrapped(RuntimeError("Timed out waiting 10000ms for send operation")), "no answer within 10 s"),
        (ValueError("FaultTolerant: the peer's state does not match\nmore"), "error: FaultTolerant: the peer's state does not match"),
        (None, "heartbeats stopped"),
    ],
)  # fmt: skip
def test_the_cause_is_read_from_the_failed_steps_error(error: Exception, cause: str) -> None:
    assert failure_cause(error, 10.0) == cause


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_death_then_a_rejoin_make_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "lightning_dist.fault_tolerant")
    clock = _Clock()
    survivor = RecoveryEvents(10.0, clock=clock)
    a, b, b2 = "0:aaa", "1:bbb", "1:ccc"
    assert survivor.quorum([a, b], a, 0, clock()) == []  # the first quorum: nothing to say
    assert survivor.quorum([a, b], a, 1, clock()) == []  # the same quorum again: nothing either
    survivor.step_failed(4, _Wrapped(RuntimeError("Connection closed by peer [127.0.0.1]:1")))
    survivor.step_failed(4, RuntimeError("a later error of the same step"))  # the first one counts
    clock.now += 0.62
    assert survivor.quorum([a], a, 4, clock()) == [
        "FaultTolerant: group 1 lost at step 4 (process exit)",
        "FaultTolerant: quorum of 1 at step 4 in 0.62 s",
    ]
    clock.now += 5
    started = clock()
    clock.now += 0.25
    assert survivor.quorum([a, b2], a, 12, started) == ["FaultTolerant: quorum of 2 at step 12 in 0.25 s"]
    healed = RecoveryEvents(10.0, clock=clock)
    assert healed.quorum([a, b2], b2, 12, clock()) == []  # a fresh process has no quorum before it
    line = healed.healed("1", "0", 12, 1_100_000_000, 0.5)
    assert line == "FaultTolerant: group 1 healed from group 0 at step 12, 1.1 GB in 0.50 s"
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "FaultTolerant: group 1 lost at step 4 (process exit)",
        "FaultTolerant: quorum of 1 at step 4 in 0.62 s",
        "FaultTolerant: quorum of 2 at step 12 in 0.25 s",
        line,
    ]
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO, logging.INFO, logging.INFO]


def test_only_the_first_survivor_speaks_and_a_failure_without_a_loss_says_so() -> None:
    """Three groups, group 0 dies: group 1 (the first survivor by id) writes the lines, group 2 and
    a group's processes beyond its first write none. A step that failed while every group stayed
    is one "not committed" line; a group gone without an error here: its heartbeats stopped."""
    clock = _Clock()
    ids = ["0:a", "1:b", "2:c"]
    speakers = {me: RecoveryEvents(10.0, clock=clock) for me in ids[1:]}
    mute = RecoveryEvents(10.0, speaks=False, clock=clock)
    for me, events in [*speakers.items(), ("1:b", mute)]:
        events.quorum(ids, me, 3, clock())
        events.step_failed(3, RuntimeError("Timed out waiting 10000ms for recv operation"))
    said = {me: events.quorum(ids[1:], me, 3, clock()) for me, events in speakers.items()}
    assert (
        said["1:b"][0] == "FaultTolerant: group 0 lost at step 3 (no answer within 10 s)"
        and said["2:c"] == []
    )
    assert mute.quorum(ids[1:], "1:b", 3, clock()) == []
    events = speakers["1:b"]
    events.step_failed(5, ValueError("bad state"))
    assert events.quorum(ids[1:], "1:b", 5, clock()) == [
        "FaultTolerant: step 5 not committed (error: bad state); the quorum runs it again"
    ]
    assert (
        events.quorum(["1:b"], "1:b", 6, clock())[0]
        == "FaultTolerant: group 2 lost at step 6 (heartbeats stopped)"
    )


def test_sizes_read_as_a_person_writes_them() -> None:
    assert [size_text(n) for n in (12, 1_900, 340_000, 1_100_000_000, 25_000_000_000)] == [
        "12 B", "1.9 kB", "340.0 kB", "1.1 GB", "25.0 GB",
    ]  # fmt: skip
