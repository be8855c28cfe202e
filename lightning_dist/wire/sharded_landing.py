"""When ``Sharded``'s gradient collectives may land after FSDP2's call returns, and the wait for them.

FSDP2 (torch 2.13, ``foreach_reduce``) ignores what its custom reduce-scatter returns and goes on
with the output at once where it post-divides it (a SUM op: fp16 reduce dtype, forced sums), casts
it to the parameters' dtype (mixed precision), adds it to a sharded gradient already there (gradient
accumulation), runs post-accumulate-grad hooks, offloads it, or hands it to the all-reduce hook
(HSDP: ``ReplicaSync``, which waits for it first). Where it does none of those it only stores views
of the output as the new sharded gradients, which nothing reads before the backward ends: then the
reduce-scatter (and the replica sync after it) may land later, overlapping the rest of the backward
as FSDP2's own collectives do on CUDA. ``Landing.may_defer`` tells, per call; ``PendingGradients``
waits for every deferred operation, in posting order, at the end of the backward (an autograd final
callback, queued behind FSDP2's own: ``loss.backward()`` returns with every gradient in place, before
Lightning's ``on_after_backward``), and again in the strategy's ``post_backward``.

Only CPU tensors are deferred: on CUDA the operations stay as they were, issued on FSDP2's
reduce-scatter stream and stream-ordered (NCCL does not block the host there anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.futures import Future


def once(land: Callable[[], None]) -> Callable[[], None]:
    """``land`` to be called from more than one place (the all-reduce hook and the end of the
    backward): it runs the first time only."""
    done = False

    def _once() -> None:
        nonlocal done
        if not done:
            done = True
            land()

    return _once


class PendingGradients:
    """The gradient collectives of one strategy left in flight during the running backward."""

    def __init__(self) -> None:
        self._waits: list[Callable[[], Any]] = []
        self.deferred = 0
        """How many operations were left in flight so far (for tests and benchmarks)."""
        self.replica_tail: Optional[Future] = None
        """The last replica sync deferred in this backward: the next one starts behind it (its later
        rounds are posted from completion callbacks, so two must not interleave)."""

    def __len__(self) -> int:
        return len(self._waits)

    def defer(self, wait: Callable[[], Any]) -> bool:
        """Keep ``wait`` (it blocks until an operation has landed, raising its error) for the end
        of the running backward. False, keeping nothing, when no backward is running (autograd
        takes final callbacks only then): the caller waits at once."""
        try:
            Variable._execution_engine.queue_callback(self.wait_all)
        except RuntimeError:
            return False
        self._waits.append(wait)
        self.deferred += 1
        return True

    def wait_all(self) -> None:
        """Wait for every deferred operation, in the order they were posted; the first error is
        raised once all were waited for."""
        waits, self._waits = self._waits, []
        self.replica_tail = None
        error: Optional[BaseException] = None
        for wait in waits:
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001  (raised below, after the others landed)
                error = error or exc
        if error is not None:
            raise error

    def clear(self) -> None:
        """Forget what is in flight without waiting (teardown after a failure: a peer may be gone)."""
        self._waits.clear()
        self.replica_tail = None


@dataclass(eq=False)
class Landing:
    """Whether one FSDP parameter group's reduce-scatter may land after FSDP2's call returns, and
    the strategy's ``pending`` set that waits for it. ``group``: FSDP2's ``FSDPParamGroup`` (its
    ``fsdp_params`` and ``_orig_dtype`` say what FSDP2 does with the output next)."""

    pending: PendingGradients
    group: Any

    @classmethod
    def of(cls, module: FSDPModule, pending: PendingGradients) -> Landing:
        """The landing of ``module``'s one FSDP parameter group."""
        (group,) = module._get_fsdp_state()._fsdp_param_groups
        return cls(pending, group)

    def may_defer(self, output: Tensor, average: bool) -> bool:
        """Whether FSDP2 only stores views of ``output`` once the reduce-scatter call returns (the
        module docstring): a CPU tensor, averaged by the collective (no post-division), already in
        the parameters' dtype, and no parameter of the group with a gradient to add to, a
        post-accumulate-grad hook or CPU offload."""
        if output.device.type != "cpu" or not average:
            return False
        orig_dtype = getattr(self.group, "_orig_dtype", None)
        if orig_dtype is not None and orig_dtype != output.dtype:
            return False
        for fsdp_param in self.group.fsdp_params:
            param = fsdp_param.sharded_param
            if param.grad is not None or getattr(param, "_post_accumulate_grad_hooks", None):
                return False
            if getattr(fsdp_param, "offload_to_cpu", False):
                return False
        return True
