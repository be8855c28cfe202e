"""``CollectiveTimeout``: a collective that did not complete within the process group's timeout.

The transports report a timed-out operation in their own words, wrapped again by every torch
future callback it passes through ("Got the following error when running the callback: ...
[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to
complete"), without saying which collective was running or what the configured timeout was.
``translate`` turns such an error into a ``CollectiveTimeout`` that says both, and what to do about
it; the original error stays its ``__cause__``, and its transport text is quoted in the message
(an error crossing a torch future callback keeps only its own text, not its cause). Any other error
passes unchanged.

An exception raised in a torch future callback reaches the waiter as a plain ``RuntimeError`` with
the text wrapped, and one from a collective that does not go through ``lightning_dist.collectives``
(torch DDP's own buffer broadcast, say) never had our words at all. ``explain`` rewrites such an
exception's message in place, the way Lightning's strategies augment messages in ``on_exception``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, Optional

__all__ = [
    "CollectiveTimeout",
    "explain",
    "is_timeout",
    "naming_timeouts",
    "timeout_message",
    "translate",
    "transport_text",
]

_TIMEOUT_TEXT = re.compile(
    r"timed out"  # Gloo: "Timed out waiting 5000ms for recv operation to complete"; NCCL: "... timed out"
    r"|operation timeout"  # NCCL: "Watchdog caught collective operation timeout: WorkNCCL(...)"
    r"|CollectiveTimeout",  # ours, re-wrapped by a torch future callback
    re.IGNORECASE,
)
_TRANSPORT = re.compile(r"gloo|nccl|c10d|ProcessGroup|Watchdog", re.IGNORECASE)  # a transport's words
_CALLBACK_PREFIX = "Got the following error when running the callback: "
_TYPE_PREFIX = re.compile(r"^[A-Za-z_][\w.]*: ")
_OURS = re.compile(r"\bCollectiveTimeout: (.*?)(?:\n\nAt:\n|$)", re.DOTALL)
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
    died, or is far slower than the others. ``op`` names the collective, ``timeout_s`` is the
    configured timeout in seconds (``None`` where the transport does not tell)."""

    def __init__(self, message: str, op: str = "", timeout_s: Optional[float] = None) -> None:
        super().__init__(message)
        self.op = op
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[Any, ...]:  # picklable (a launcher may send it to another process)
        return (type(self), (str(self), self.op, self.timeout_s))


def _timed_out(exc: BaseException) -> Optional[BaseException]:
    """``exc``, or the first exception it was raised from, that reports a timed-out operation."""
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, CollectiveTimeout) or (isinstance(e, RuntimeError) and _TIMEOUT_TEXT.search(str(e))):
            return e
        seen.add(id(e))
        e = e.__cause__
    return None


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) reports a timed-out transport operation."""
    return _timed_out(exc) is not None


def _named(exc: BaseException) -> Optional[str]:
    """The message of the ``CollectiveTimeout`` that ``exc`` is, or whose text it carries."""
    if isinstance(exc, CollectiveTimeout):
        return str(exc)
    found = _OURS.search(str(exc))
    return found.group(1).strip() if found else None


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


def translate(
    exc: BaseException,
    op: str,
    *,
    detail: str = "",
    transport: str = "",
    timeout_s: Optional[float] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> BaseException:
    """``exc`` as a ``CollectiveTimeout`` when it reports a timeout, else ``exc`` itself.

    ``op`` names the collective (``all_reduce``, ``broadcast``, ...), ``detail`` adds what it was
    moving (reduction, element count and dtype), ``transport`` the process group's backend
    (``gloo``, ``nccl``), ``timeout_s`` its configured timeout in seconds. The returned error has
    ``exc`` as its ``__cause__``. An error that already is a ``CollectiveTimeout`` is returned as is;
    one that was a ``CollectiveTimeout`` before a torch future callback re-wrapped it as a
    ``RuntimeError`` becomes one again, with its message unchanged.
    """
    found = _timed_out(exc)
    if found is None or isinstance(exc, CollectiveTimeout):
        return exc
    message = _named(found) or timeout_message(
        op,
        detail=detail,
        transport=transport,
        timeout_s=timeout_s,
        rank=rank,
        world_size=world_size,
        cause=transport_text(found),
    )
    new = CollectiveTimeout(message, op, timeout_s)
    new.__cause__ = exc
    return new


def explain(exc: BaseException, op: Optional[str] = None, **context: Any) -> bool:
    """Rewrite the message of ``exc``, in place, when it reports a timed-out collective: to the
    ``CollectiveTimeout`` message it carries (a ``RuntimeError`` re-wrapped by torch future
    callbacks), else to a new one naming ``op`` (default: what the innermost torch function on its
    stack was doing, see ``failing_call``) and ``context`` (as ``translate`` takes it) and quoting the
    transport's words. The type stays; returns whether it was a timed-out collective.

    For a strategy's ``on_exception``, which sees every exception of a fit before Lightning re-raises
    it: a timeout that is neither ours nor in a transport's words nor raised inside torch.distributed
    or DDP (a DataLoader's "timed out", say) is left alone."""
    found = _timed_out(exc)
    if found is None:
        return False
    if isinstance(exc, CollectiveTimeout):
        return True
    message = _named(found)
    if message is None:
        subject = op or failing_call(exc)
        if subject == "a collective" and not _TRANSPORT.search(str(found)):
            return False
        message = timeout_message(subject, cause=transport_text(found), **context)
    exc.args = (message,)
    return True


@contextlib.contextmanager
def naming_timeouts(op: str, **context: Any) -> Iterator[None]:
    """Raise a timeout inside the block as ``translate(exc, op, **context)``, from the original."""
    try:
        yield
    except Exception as exc:
        new = translate(exc, op, **context)
        if new is exc:
            raise
        raise new from exc
