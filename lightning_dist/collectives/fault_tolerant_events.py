"""One log line per failure and recovery of a live-recovery run, from the pack's logger
(``lightning_dist.fault_tolerant``), instead of torchft's lines per step and its tracebacks:

    FaultTolerant: group 1 lost at step 1204 (process exit)
    FaultTolerant: quorum of 2 at step 1204 in 0.62 s
    FaultTolerant: group 1 healed from group 0 at step 1221, 1.1 GB in 0.50 s
    FaultTolerant: step 88 not committed (error: ...); the quorum runs it again

A lost group and the quorum that follows are written once for the run, by one survivor (the first,
by replica id, of the groups in both quorums; its process 0); a heal by the group that healed; a
step that failed while every group stayed, by the same survivor. The cause of a loss is read from
the error the failed step recorded: ``process exit`` (its connections closed: the process died),
``no answer within T s`` (a collective timed out: a stopped or hung peer), or, with no error in
this group (it left between steps), ``heartbeats stopped``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Optional

from lightning_dist.collectives.timeouts import reports_timeout

logger = logging.getLogger("lightning_dist.fault_tolerant")
_HANDLER = logging.StreamHandler(sys.stderr)
_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(message)s"))

_EXITED = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "end of file")


def show_events(log: logging.Logger = logger) -> None:
    """The event lines at INFO on stderr when nothing else would show them (no handler of the
    user's on the logger or the root; a level the user set is kept)."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(_HANDLER)


def group_of(replica_id: str) -> str:
    """The group's id in torchft's replica id (``<id>:<uuid of this process>``)."""
    return replica_id.split(":", 1)[0]


def failure_cause(error: Optional[BaseException], timeout_s: float) -> str:
    """What a failed step's recorded ``error`` says of the peer (module docstring)."""
    if error is None:
        return "heartbeats stopped"
    inner = getattr(error, "original_exception", error)  # torchft's ExceptionWithTraceback
    if reports_timeout(inner):
        return f"no answer within {timeout_s:g} s"
    text = str(inner).strip()
    if any(words in text.lower() for words in _EXITED):
        return "process exit"
    first = text.splitlines()[0] if text else type(inner).__name__
    return f"error: {first[:120]}"


def size_text(nbytes: int) -> str:
    """``nbytes`` as "1.1 GB", "340 kB", "12 B" (powers of 1000)."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


class RecoveryEvents:
    """Turns a group's quorums, failed steps and heals into the module docstring's lines.
    ``timeout_s``: the collectives' timeout (named in a timed-out loss); ``speaks``: whether this
    process may write the run-wide lines (process 0 of its group)."""

    def __init__(
        self,
        timeout_s: float,
        speaks: bool = True,
        log: logging.Logger = logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s, self.speaks, self.log, self.clock = timeout_s, speaks, log, clock
        self._members: Optional[frozenset[str]] = None
        self._failure: Optional[tuple[int, str, float]] = None

    def step_failed(self, step: int, error: Optional[BaseException]) -> None:
        """Step ``step`` was not committed; ``error``: what this group recorded (None: nothing here)."""
        if self._failure is None:
            cause = failure_cause(error, self.timeout_s) if error is not None else "a peer failed"
            self._failure = (step, cause, self.clock())

    def quorum(self, replica_ids: Sequence[str], mine: str, step: int, started: float) -> list[str]:
        """A quorum of ``replica_ids`` (this group: ``mine``) at ``step``, asked for at ``started``
        (``clock``'s time); returns (and logs) the lines it makes."""
        members = frozenset(replica_ids)
        before, self._members = self._members, members
        failure, self._failure = self._failure, None
        if before is None or before == members and failure is None:
            return []
        stayed = sorted(before & members)
        if not self.speaks or not stayed or stayed[0] != mine:
            return []
        lines: list[tuple[int, str]] = []
        lost = sorted(group_of(r) for r in before - members)
        at = failure[0] if failure is not None else step
        cause = "heartbeats stopped" if failure is None or failure[1] == "a peer failed" else failure[1]
        lines += [(logging.WARNING, f"FaultTolerant: group {g} lost at step {at} ({cause})") for g in lost]
        if before != members:
            since = failure[2] if failure is not None else started
            took = self.clock() - since
            lines.append(
                (logging.INFO, f"FaultTolerant: quorum of {len(members)} at step {step} in {took:.2f} s")
            )
        elif failure is not None:
            lines.append(
                (
                    logging.WARNING,
                    f"FaultTolerant: step {failure[0]} not committed ({failure[1]}); the quorum runs it again",
                )
            )
        for level, line in lines:
            self.log.log(level, line)
        return [line for _, line in lines]

    def healed(self, group: str, source: str, step: int, nbytes: int, seconds: float) -> str:
        """This group (``group``) loaded ``source``'s state of ``step``: ``nbytes`` in ``seconds``."""
        line = f"FaultTolerant: group {group} healed from group {source} at step {step}, {size_text(nbytes)} in {seconds:.2f} s"
        if self.speaks:
            self.log.info(line)
        return line
