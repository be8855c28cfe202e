"""``CollectiveTimeout``: a collective that did not complete within the process group's timeout.

The transports report a timed-out operation in their own words ("[gloo/transport/tcp/unbound_buffer.cc:78]
Timed out waiting 5000ms for recv operation to complete"), without saying which collective was
running or what the configured timeout was. A communicator's own waits raise a ``CollectiveTimeout``
that says both, and what to do about it, raised from the transport's error (``translate``,
``naming_timeouts``). An error raised elsewhere (Lightning re-raising a failed DDP comm hook future
as a plain ``RuntimeError``, torch DDP's own buffer broadcast, which bypasses the pack) is left as it
is: a strategy's ``on_exception`` adds a note to it (``add_timeout_note``: ``exc.add_note``) when it
reports a timed-out collective, with what the pack knows (the collective its communicator saw time
out, or the torch call that did, the timeout, what to do); its type and args stay.

torch has no exception type for a timeout (Gloo raises a plain ``RuntimeError``, NCCL's watchdog a
``DistBackendError``, each saying so in words), so one function reads the words: ``reports_timeout``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch.distributed as dist

__all__ = [
    "CollectiveTimeout",
    "add_timeout_note",
    "failing_call",
    "is_timeout",
    "naming_timeouts",
    "reports_timeout",
    "timeout_message",
    "translate",
    "transport_text",
]

_TIMED_OUT = re.compile(r"timed out|operation timeout", re.IGNORECASE)
_COLLECTIVE = re.compile(r"gloo|nccl|c10d|ProcessGroup|Watchdog|CollectiveTimeout", re.IGNORECASE)
_CALLBACK_PREFIX = "Got the following error when running the callback: "
_TYPE_PREFIX = re.compile(r"^[A-Za-z_][\w.]*: ")
_STACK = "\n\nAt:\n"  # where torch's callback wrapping appends the callback's Python stack

# What a timed-out call inside torch was doing, by the innermost torch function on the stack.
_TORCH_CALLS = {
    "_distributed_broadcast_coalesced": "the broadcast of module buffers by torch DDP (broadcast_buffers=True)",
    "_sync_module_states": "the broadcast of the initial parameters and buffers by torch DDP",
    "_verify_param_shape_across_processes": "the parameter-shape check of torch DDP",
    "_engine_run_backward": "a collective of torch DDP's gradient reduction during backward",
}


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout: a rank stopped, hung or
    died, or is far slower than the others. ``op`` names the collective, ``detail`` what it moved,
    ``timeout_s`` is the configured timeout in seconds (``None`` where the transport does not tell)."""

    def __init__(
        self, message: str, op: str = "", timeout_s: Optional[float] = None, detail: str = ""
    ) -> None:
        super().__init__(message)
        self.op = op
        self.timeout_s = timeout_s
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (a launcher may send it to another process)
        return (type(self), (str(self), self.op, self.timeout_s, self.detail))


def reports_timeout(exc: BaseException, *, from_transport: bool = False) -> bool:
    """Whether ``exc`` itself reports a timed-out operation: a ``CollectiveTimeout``, or a
    ``RuntimeError`` (``DistBackendError`` is one) that says so. ``from_transport``: for an error
    from outside the pack, also require a ``DistBackendError`` or a transport's words (or ours,
    re-wrapped by a torch future callback): a DataLoader's "timed out" is not a collective's. The
    only place that reads an error's words."""
    if isinstance(exc, CollectiveTimeout):
        return True
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not _TIMED_OUT.search(text):
        return False
    return not from_transport or isinstance(exc, dist.DistBackendError) or bool(_COLLECTIVE.search(text))


def _timed_out(exc: BaseException) -> Optional[BaseException]:
    """``exc``, or the first exception it was raised from, that reports a timed-out operation."""
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        if reports_timeout(e):
            return e
        seen.add(id(e))
        e = e.__cause__
    return None


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) reports a timed-out transport operation."""
    return _timed_out(exc) is not None


def transport_text(exc: BaseException) -> str:
    """``exc``'s own text without torch's future-callback wrapping: the "Got the following error when
    running the callback: RuntimeError: ..." prefixes and the "At:" stack sections."""
    text = str(exc)
    while text.startswith(_CALLBACK_PREFIX):
        text = _TYPE_PREFIX.sub("", text[len(_CALLBACK_PREFIX) :], count=1)
    return text.split(_STACK, 1)[0].strip()


def failing_call(exc: BaseException) -> str:
    """What the innermost torch function on ``exc``'s stack was doing, as the subject of a
    ``timeout_message`` ("a collective" when no torch function is on it)."""
    tb = exc.__traceback__
    name = ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in path or "/torch/nn/parallel/" in path or "/torch/autograd/" in path:
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    if not name:
        return "a collective"
    return _TORCH_CALLS.get(name, f"{name} (called in torch)")


def _seconds(timeout_s: float) -> str:
    text = f"{timeout_s:g} s"
    if timeout_s >= 120:
        text += f" ({timeout_s / 60:g} min)"
    return text


def timeout_message(
    op: str,
    *,
    detail: str = "",
    transport: str = "",
    timeout_s: Optional[float] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    cause: str = "",
) -> str:
    """The text of a ``CollectiveTimeout`` (see ``translate`` for the arguments; ``cause``: the
    transport's own words, quoted). An ``op`` that starts with "a " or "the " is a description
    ("the broadcast of ...") rather than a collective's name."""
    subject = op if op.startswith(("a ", "the ")) else f"collective {op}"
    what = f"{subject} ({detail})" if detail else subject
    where = (
        f" on rank {rank}" + (f" of {world_size}" if world_size is not None else "")
        if rank is not None
        else ""
    )
    via = f" over {transport}" if transport else ""
    limit = (
        f"within the process group's timeout of {_seconds(timeout_s)}"
        if timeout_s is not None
        else "within the process group's timeout"
    )
    longer = f"longer than {_seconds(timeout_s)}" if timeout_s is not None else "longer"
    quoted = f" ({cause})" if cause else ""
    return (
        f"{what} timed out{where}{via}: it did not complete {limit}{quoted}. "
        "Another rank has stopped, hung or died, or is far slower than this one: check that every rank is "
        "alive and making progress (a stopped or swapping process, a lost node, one rank stuck in its own "
        f"work). If a step legitimately takes {longer}, raise the strategy's timeout= "
        "(e.g. DDP(timeout=timedelta(minutes=30)))."
    )


def translate(exc: BaseException, op: str, **context: Any) -> BaseException:
    """A new ``CollectiveTimeout`` when ``exc`` (the error of a collective this pack posted) reports
    a timeout, else ``exc`` itself; one that already is a ``CollectiveTimeout`` is returned as is.

    ``op`` names the collective (``all_reduce``, ``broadcast``, ...); ``context`` is what
    ``timeout_message`` takes: ``detail`` (what it was moving: reduction, element count and dtype),
    ``transport`` (the process group's backend: ``gloo``, ``nccl``), ``timeout_s`` (its configured
    timeout in seconds), ``rank`` and ``world_size``. The new error quotes the transport's words and
    has ``exc`` as its ``__cause__``.
    """
    found = _timed_out(exc)
    if found is None or isinstance(exc, CollectiveTimeout):
        return exc
    message = timeout_message(op, cause=transport_text(found), **context)
    new = CollectiveTimeout(message, op, context.get("timeout_s"), context.get("detail", ""))
    new.__cause__ = exc
    return new


@contextlib.contextmanager
def naming_timeouts(
    op: str, record: Optional[Callable[[CollectiveTimeout], Any]] = None, **context: Any
) -> Iterator[None]:
    """Raise a timeout inside the block as ``translate(exc, op, **context)``, from the original;
    ``record`` (a communicator's log of its timeouts) is handed each one raised."""
    try:
        yield
    except Exception as exc:
        new = translate(exc, op, **context)
        if new is exc:
            raise
        assert isinstance(new, CollectiveTimeout)
        if record is not None:
            record(new)
        raise new from exc


def add_timeout_note(
    exc: BaseException, recorded: Optional[CollectiveTimeout] = None, **context: Any
) -> bool:
    """A strategy's ``on_exception``: when ``exc``, raised outside the pack's own waits, reports a
    timed-out collective, add a note (``exc.add_note``, once) saying which collective, the timeout
    and what to do; ``exc``'s type and args stay. Returns whether it has one now.

    The note is ``recorded``'s message (the last timeout the strategy's communicator saw: a DDP comm
    hook's future fails with it, and Lightning re-raises a plain ``RuntimeError``), else a
    ``timeout_message`` about ``failing_call(exc)`` with ``context`` (as ``translate`` takes it)
    quoting the transport's words. A ``CollectiveTimeout`` already says it all; a timeout neither in
    a transport's words nor raised inside torch.distributed or DDP (a DataLoader's "timed out") gets
    no note."""
    found = _timed_out(exc)
    if found is None or isinstance(exc, CollectiveTimeout):
        return False
    subject = failing_call(exc)
    if subject == "a collective" and not reports_timeout(found, from_transport=True):
        return False
    if recorded is not None:
        note = str(recorded)
    else:
        note = timeout_message(subject, cause=transport_text(found), **context)
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return True
