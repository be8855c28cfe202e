"""The one place that talks to a transport.

Module-level functions act on the *current* communicator: the one a strategy installed with
``use``, else the default torch.distributed world group when one is initialised, else the
single-process twin. Every call counts bytes and seconds; read them with ``stats()`` and zero them
with ``reset_stats()``; ``trace.recording()`` records each call (op, bytes, start and end) for
``callbacks.Timeline``. A collective that outlives the process group's timeout raises
``CollectiveTimeout``, naming the collective and the timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives import trace
from lightning_dist.collectives.accounting import CommStats, OpStats, ring_all_reduce_bytes
from lightning_dist.collectives.backend import REDUCE_OPS, Backend, check_reduce_op
from lightning_dist.collectives.communicator import PROCESS_STATS, Communicator, TensorOrList
from lightning_dist.collectives.completer import stop_all
from lightning_dist.collectives.single import SingleProcessBackend
from lightning_dist.collectives.timeouts import CollectiveTimeout, explain
from lightning_dist.collectives.torch_backend import TorchBackend

__all__ = [
    "REDUCE_OPS",
    "Backend",
    "CollectiveTimeout",
    "CommStats",
    "Communicator",
    "OpStats",
    "SingleProcessBackend",
    "TorchBackend",
    "all_gather",
    "all_gather_async",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "check_reduce_op",
    "current",
    "explain_timeout",
    "reduce_scatter",
    "reduce_scatter_async",
    "release",
    "reset_stats",
    "shutdown",
    "spans",
    "ring_all_reduce_bytes",
    "stats",
    "trace",
    "use",
]

_installed: Optional[Communicator] = None
_default: Optional[Communicator] = None


def use(backend: Optional[Backend | Communicator]) -> Optional[Communicator]:
    """Make ``backend`` the current transport (``None`` goes back to auto-detection)."""
    global _installed
    if backend is None or isinstance(backend, Communicator):
        _installed = backend
    else:
        _installed = Communicator(backend)
    return _installed


def current() -> Communicator:
    """The communicator module-level calls use now."""
    global _default
    if _installed is not None:
        return _installed
    if dist.is_available() and dist.is_initialized():
        world = dist.group.WORLD
        if (
            _default is None
            or not isinstance(_default.backend, TorchBackend)
            or _default.backend.group is not world
        ):
            _default = Communicator(TorchBackend(world))
        return _default
    if _default is None or not isinstance(_default.backend, SingleProcessBackend):
        _default = Communicator(SingleProcessBackend())
    return _default


def spans(group: Any) -> bool:
    """Whether the current communicator's collectives answer for the ``torch.distributed`` group
    ``group``: ``None``, the default (world) group, or any group of exactly its ranks."""
    return current().spans(group)


def stats() -> CommStats:
    """This process's counters (shared by all default communicators)."""
    return current().stats if _installed is not None else PROCESS_STATS


def reset_stats() -> None:
    stats().reset()


def all_reduce(tensor: TensorOrList, op: str = "sum") -> Any:
    return current().all_reduce(tensor, op)


def all_reduce_async(tensor: TensorOrList, op: str = "sum") -> Future:
    return current().all_reduce_async(tensor, op)


def broadcast(tensor: Tensor, src: int = 0) -> Tensor:
    return current().broadcast(tensor, src)


def broadcast_async(tensor: Tensor, src: int = 0) -> Future:
    return current().broadcast_async(tensor, src)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    return current().broadcast_object(obj, src)


def all_gather(tensor: Tensor, same_shape: bool = False) -> list[Tensor]:
    return current().all_gather(tensor, same_shape)


def all_gather_async(tensor: Tensor, same_shape: bool = False) -> Future:
    return current().all_gather_async(tensor, same_shape)


def reduce_scatter(tensor: TensorOrList, op: str = "sum") -> Tensor:
    return current().reduce_scatter(tensor, op)


def reduce_scatter_async(tensor: TensorOrList, op: str = "sum") -> Future:
    return current().reduce_scatter_async(tensor, op)


def all_to_all(inputs: Sequence[Tensor]) -> list[Tensor]:
    return current().all_to_all(inputs)


def all_to_all_async(inputs: Sequence[Tensor]) -> Future:
    return current().all_to_all_async(inputs)


def barrier() -> None:
    current().barrier()


def release() -> None:
    """A strategy's teardown: back to auto-detection and no helper thread left running (a helper
    thread alive when the interpreter finalises can abort the process)."""
    global _default
    use(None)
    _default = None
    stop_all()


def explain_timeout(exception: BaseException) -> bool:
    """A strategy's ``on_exception``: when ``exception`` reports a timed-out collective, rewrite its
    message (in place; the type stays) to name the collective, the transport, its configured timeout
    and what to do. It covers what reaches Lightning as a plain ``RuntimeError``: a
    ``CollectiveTimeout`` re-wrapped by torch (a DDP comm hook's future) and a timeout in a
    collective that bypasses this module (torch DDP's buffer broadcast). Returns whether it was one."""
    comm = _installed if _installed is not None else _default
    context: dict[str, Any] = {}
    try:
        if comm is not None and comm.world_size > 1:
            context = comm.timeout_context()
    except Exception:  # noqa: BLE001  (a broken transport: explain without it)
        context = {}
    return explain(exception, **context)


def shutdown() -> None:
    """End of a distributed script: ``release`` and destroy the default process group, so nothing
    of the transport is left to interpreter finalisation ("terminate called without an active
    exception" after all the work is done)."""
    release()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
