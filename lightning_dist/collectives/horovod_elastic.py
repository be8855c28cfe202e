"""Horovod's elastic engine (``hvd.elastic``) for a whole training attempt: an in-memory commit
state and the run loop that resets Horovod when a worker fails or the host set changes.

Horovod's ``hvd.elastic.run`` calls a function again after ``hvd.shutdown(); hvd.init()`` when a
collective raised ``HorovodInternalError`` (a worker died: the state goes back to its last commit)
or a commit raised ``HostsUpdatedInterrupt`` (the discovery script's host list changed: the state is
the one just committed). Before each call, except after a removal alone, ``State.sync`` broadcasts
rank 0's state, so a worker that joins starts from it. ``CommitState`` holds one opaque commit
(whatever a strategy stages: the pack's ``Elastic`` commit payload) in every process's memory.

Horovod is imported when a state is made or a run starts, not when this module is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from typing import Any, Optional, TypeVar

from lightning_dist.collectives.horovod_backend import import_horovod

logger = logging.getLogger(__name__)

R = TypeVar("R")

__all__ = ["CommitState", "elastic_run", "horovod_failure", "make_commit_state"]


class CommitState:
    """What a strategy sees of the elastic state (the class ``make_commit_state`` builds adds
    Horovod's ``State`` machinery: host-update checks, reset callbacks)."""

    committed: Optional[Any]
    """The last commit (``None`` before the first): the same on every rank after ``sync``."""
    resets: int
    """Resets so far (worker failures and host changes)."""

    def stage(self, payload: Any) -> None:
        """Hold ``payload`` as the commit that the next ``commit`` makes (on every rank)."""
        raise NotImplementedError

    def commit(self) -> None:
        """Make the staged payload the commit, then check for host changes: raises Horovod's
        ``HostsUpdatedInterrupt`` on every rank alike when hosts were added or removed."""
        raise NotImplementedError


@cache
def _state_class() -> type:
    """``CommitState`` over Horovod's ``State`` (built once Horovod is importable)."""
    hvd = import_horovod()
    from horovod.common.elastic import State

    class _HorovodCommitState(State, CommitState):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
            self.committed: Optional[Any] = None
            self.resets = 0
            self._staged: Optional[Any] = None

        def stage(self, payload: Any) -> None:
            self._staged = payload

        def save(self) -> None:
            if self._staged is not None:
                self.committed, self._staged = self._staged, None

        def restore(self) -> None:
            self._staged = None  # back to the last commit

        def sync(self) -> None:
            self.committed = self._bcast_object(self.committed, name="lightning_dist.elastic.commit")

        def reset(self) -> None:
            self.resets += 1
            logger.info("Horovod elastic: reset %d, now rank %d of %d", self.resets, hvd.rank(), hvd.size())

    return _HorovodCommitState


def make_commit_state() -> CommitState:
    """A new state for ``elastic_run`` (Horovod initialised first: ``sync`` broadcasts)."""
    hvd = import_horovod()
    if not hvd.is_initialized():
        hvd.init()
    state: CommitState = _state_class()()
    return state


def horovod_failure(exc: BaseException) -> Optional[BaseException]:
    """The ``HorovodInternalError`` behind ``exc`` (itself, a cause or context in its chain), or a
    new one when only its text names it, or None. A Horovod op's error reaches the waiter wrapped:
    torch hands an exception raised in a future's callback on as a ``RuntimeError`` holding its
    text ("Got the following error when running the callback: HorovodInternalError: ...")."""
    from horovod.common.exceptions import HorovodInternalError

    seen: set[int] = set()
    link: Optional[BaseException] = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, HorovodInternalError):
            return link
        if f"{HorovodInternalError.__name__}:" in str(link):
            return HorovodInternalError(str(link))
        link = link.__cause__ or link.__context__
    return None


def elastic_run(fn: Callable[[CommitState], R], state: CommitState) -> R:
    """``fn(state)`` under ``hvd.elastic.run``: called again, on the new set of workers, after a
    worker failure or a host change, until it returns. ``fn`` must not start with a collective
    (Horovod's rule: a joining worker syncs the state first). An error of a failed Horovod op is
    raised to Horovod's loop as the ``HorovodInternalError`` it catches, whatever wrapped it."""
    hvd = import_horovod()
    from horovod.common.exceptions import HostsUpdatedInterrupt

    def attempt(state: CommitState) -> R:
        try:
            return fn(state)
        except HostsUpdatedInterrupt:
            raise
        except Exception as exc:
            failure = horovod_failure(exc)
            if failure is None or failure is exc:
                raise
            raise failure from exc

    result: R = hvd.elastic.run(attempt)(state)
    return result
