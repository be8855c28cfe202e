"""The one place that talks to a transport.

A ``Communicator`` does every collective over one ``Backend`` (a torch process group, Horovod, or the
single-process twin) and counts the bytes and seconds of each call into its own ``stats``
(``CommStats``). A strategy makes its communicator when it sets up its process group, exposes it as
``strategy.communicator`` and hands it to its hooks; the pack's code never reaches for a
module-level transport. ``trace.recording()`` records each call (op, bytes, start and end) for
``callbacks.Timeline``. A collective that outlives the process group's timeout raises
``CollectiveTimeout``, naming the collective and the timeout.

For user code (scripts, notebooks) the module-level functions (``all_reduce``, ``broadcast`` ...)
act on ``world()``: a communicator over torch.distributed's default (world) group, made on demand,
or the single-process twin when no group is initialised. Its counters are ``world().stats``;
a strategy's are ``trainer.strategy.communicator.stats``. ``shutdown()`` ends a distributed script.
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
from lightning_dist.collectives.communicator import Communicator, TensorOrList
from lightning_dist.collectives.single import SingleProcessBackend
from lightning_dist.collectives.timeouts import CollectiveTimeout
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
    "reduce_scatter",
    "reduce_scatter_async",
    "ring_all_reduce_bytes",
    "shutdown",
    "trace",
    "world",
]

_world: Optional[Communicator] = None
"""The communicator ``world()`` made last (user code only; no strategy reads it)."""


def world() -> Communicator:
    """For user code: a communicator over torch.distributed's default (world) group, made when first
    asked for (again when that group changes), or the single-process twin when none is initialised.

    A strategy's collectives go through its own ``strategy.communicator``, not this one: the two
    count separately."""
    global _world
    comm = _world
    if dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
        backend = None if comm is None else comm.backend
        if not isinstance(backend, TorchBackend) or backend.group is not group:
            _close_world()
            comm = _world = Communicator(TorchBackend(group))
    elif comm is None or not isinstance(comm.backend, SingleProcessBackend):
        _close_world()
        comm = _world = Communicator(SingleProcessBackend())
    assert comm is not None
    return comm


def _close_world() -> None:
    global _world
    if _world is not None:
        _world.close()
    _world = None


def all_reduce(tensor: TensorOrList, op: str = "sum") -> Any:
    return world().all_reduce(tensor, op)


def all_reduce_async(tensor: TensorOrList, op: str = "sum") -> Future:
    return world().all_reduce_async(tensor, op)


def broadcast(tensor: Tensor, src: int = 0) -> Tensor:
    return world().broadcast(tensor, src)


def broadcast_async(tensor: Tensor, src: int = 0) -> Future:
    return world().broadcast_async(tensor, src)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    return world().broadcast_object(obj, src)


def all_gather(tensor: Tensor, same_shape: bool = False) -> list[Tensor]:
    return world().all_gather(tensor, same_shape)


def all_gather_async(tensor: Tensor) -> Future:
    return world().all_gather_async(tensor)


def reduce_scatter(tensor: TensorOrList, op: str = "sum") -> Tensor:
    return world().reduce_scatter(tensor, op)


def reduce_scatter_async(tensor: TensorOrList, op: str = "sum") -> Future:
    return world().reduce_scatter_async(tensor, op)


def all_to_all(inputs: Sequence[Tensor], output_rows: Optional[Sequence[int]] = None) -> list[Tensor]:
    return world().all_to_all(inputs, output_rows)


def all_to_all_async(inputs: Sequence[Tensor], output_rows: Sequence[int]) -> Future:
    return world().all_to_all_async(inputs, output_rows)


def barrier() -> None:
    world().barrier()


def shutdown() -> None:
    """End of a distributed script: close ``world()``'s communicator, if one was made, and destroy
    the default process group, so nothing of the transport is left to interpreter finalisation
    ("terminate called without an active exception" after all the work is done)."""
    _close_world()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
