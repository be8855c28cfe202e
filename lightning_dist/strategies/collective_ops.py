"""Lightning's reduce / all_gather / broadcast / barrier, answered by the strategy's own communicator.

Shared by every strategy so logging (``sync_dist=True``), metrics and checkpoint decisions cross
the same accounted transport as gradients. The strategy owns its ``Communicator``: it makes one when
it sets up its process group (``_set_communicator``), exposes it as ``communicator`` (``None``
before), hands it to its hooks, and closes it at teardown, which stops that communicator's helper
threads and no one else's.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import torch
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from typing_extensions import override

from lightning_dist.collectives import Communicator, SingleProcessBackend
from lightning_dist.collectives.autograd import all_gather_with_grad
from lightning_dist.strategies.options import op_name

T = TypeVar("T")


def _check_group(method: str, group: Optional[Any], comm: Communicator) -> None:
    """Every collective spans all ranks of the strategy's communicator: ``None`` and the default
    (world) group are that, and so is any group of exactly those ranks; a sub-group is refused."""
    if not comm.spans(group):
        raise ValueError(
            f"{method}(group={group!r}) is not supported: lightning_dist strategies reduce over all "
            f"{comm.world_size} ranks of their communicator; accepted: group=None, "
            "torch.distributed.group.WORLD or a group of all those ranks (for sync_dist logging, leave "
            "sync_dist_group unset)"
        )


class CollectiveOpsMixin(Strategy):
    """Lightning's collective methods for a strategy, and the strategy's ``communicator``; put it
    before the Lightning base class (``class DDP(CollectiveOpsMixin, DDPStrategy)``)."""

    _communicator: Optional[Communicator] = None

    @property
    def communicator(self) -> Optional[Communicator]:
        """This strategy's transport, with its counters (``communicator.stats``): made when the
        strategy sets up its process group, ``None`` before. After teardown it stays (its helper
        threads stopped), so that collectives after ``fit`` (``trainer.save_checkpoint``) still work."""
        return self._communicator

    def _set_communicator(self, comm: Communicator) -> None:
        """Make ``comm`` this strategy's transport (closing the one it replaces)."""
        if self._communicator is not None and self._communicator is not comm:
            self._communicator.close()
        self._communicator = comm

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then stop the helper threads of this strategy's own communicator."""
        super().teardown()
        if self._communicator is not None:
            self._communicator.close()

    def _transport(self) -> Communicator:
        """The communicator; before setup (no process group yet) the single-process twin, as
        Lightning's own strategies act as one process until their group exists."""
        comm = self._communicator
        return Communicator(SingleProcessBackend()) if comm is None else comm

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Before Lightning re-raises ``exception``: a note on it when it reports a timed-out
        collective (which one, the timeout, what to do; ``Communicator.note_timeout``)."""
        self._transport().note_timeout(exception)
        super().on_exception(exception)

    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[Tensor, Any]:
        comm = self._transport()
        _check_group("reduce", group, comm)
        if not isinstance(tensor, Tensor):
            return tensor
        op = op_name(reduce_op, ("sum", "avg", "min", "max"), argument="reduce_op", default="avg")
        if op == "avg" and not tensor.is_floating_point():
            # Lightning truncates an integer mean back into the integer tensor; this returns it exactly
            return comm.all_reduce(tensor.float(), op)
        return comm.all_reduce(tensor, op)  # in place, as Lightning's DDPStrategy

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        comm = self._transport()
        _check_group("all_gather", group, comm)
        if sync_grads:
            return all_gather_with_grad(comm, tensor)
        return torch.stack(comm.all_gather(tensor.contiguous(), same_shape=True))

    @override
    def broadcast(self, obj: T, src: int = 0) -> T:
        return self._transport().broadcast_object(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._transport().barrier()
