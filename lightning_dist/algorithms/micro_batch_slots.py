"""What Lightning's loop sees of a ``FaultTolerant`` step: only the micro-batches this process trains.

A step is ``M`` micro-batch slots shared by the quorum's processes, so how many a process trains
is known only once the step's quorum has formed. Lightning iterates ``OwnBatches`` (the process's
batches, read after each quorum) and steps at every batch (``accumulate_grad_batches=1``); the
strategy sums a step's gradients itself (``GradientSum``), steps once after the step's last batch,
and scales each batch's loss by ``1/M`` (``scaled_loss``), as Lightning scales an accumulated
micro-batch's, so a batch's hooks, its ``training_step`` and its outputs go together and the update is
the one of ``M`` accumulated micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

from torch import Tensor


def owns_slot(slot: int, participants: int, rank: Optional[int]) -> bool:
    """Whether the quorum's participant ``rank`` (None: not participating) computes ``slot``: slot j
    goes to participant ``j % participants``, so every slot of a step has exactly one owner."""
    return rank is not None and slot % participants == rank


def owned_slots(slots: int, participants: int, rank: Optional[int]) -> int:
    """How many of a step's ``slots`` the quorum's participant ``rank`` computes (``owns_slot``)."""
    return sum(owns_slot(j, participants, rank) for j in range(slots))


def group_slots(slots: int, participants: int, group_size: int, rank: Optional[int]) -> int:
    """How many of a step's ``slots`` the ``group_size`` processes of the quorum's participant
    ``rank`` compute together (process ``g`` of participant ``p`` is ``p x group_size + g``)."""
    if rank is None:
        return 0
    return sum(
        owned_slots(slots, participants * group_size, rank * group_size + g) for g in range(group_size)
    )


class OwnBatches:
    """The training loader Lightning iterates: ``batches()`` (a new iterator per epoch). Its length,
    what one process trains in an epoch with every group there, keeps Lightning's fetcher from
    reading a batch ahead (it prefetches only from loaders without one), so each step's quorum comes
    after the previous step's last batch has stepped."""

    def __init__(self, batches: Callable[[], Iterator[Any]], length: int, dataset: Any) -> None:
        self._batches = batches
        self.length = length
        self.dataset = dataset
        """The user's dataset (the samples are read from it)."""

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        return self._batches()


def slots_per_process(slots: int, processes: int) -> int:
    """The most slots one of ``processes`` trains in a step of ``slots`` (slot j to process
    ``j % processes``)."""
    return -(-slots // processes)


def scaled_loss(output: Any, slots: int) -> Any:
    """``training_step``'s output with its loss divided by ``slots`` (a tensor, or a mapping's
    ``"loss"``), as Lightning divides an accumulated micro-batch's; anything else as it is."""
    if isinstance(output, Tensor):
        return output / slots
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": output["loss"] / slots}
    return output


class GradientSum:
    """A step's gradients summed over this process's batches, held outside ``.grad`` between them
    (Lightning clears ``.grad`` before each batch's backward pass when it does not accumulate).
    The sum is autograd's own accumulation (``held += new`` in batch order), so it is bitwise the
    gradient Lightning's accumulation gives."""

    def __init__(self) -> None:
        self._held: dict[int, Tensor] = {}

    def add(self, params: list[Tensor]) -> None:
        """Take each parameter's ``.grad`` into the sum (and clear it)."""
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            held = self._held.get(i)
            if held is None:
                self._held[i] = p.grad
            else:
                held.add_(p.grad)
            p.grad = None

    def restore(self, params: list[Tensor]) -> None:
        """Put the sum back in ``.grad`` (None where no batch gave one) and start a new one."""
        for i, p in enumerate(params):
            p.grad = self._held.get(i)
        self._held = {}
