"""Skip an optimizer step on every rank when any rank's gradients hold NaN or Inf.

After the closure (forward, backward, gradient reduction) each rank checks its own gradients, one
flag is all-reduced with ``max`` through the strategy's communicator, and when it is set every rank drops its
gradients (``grad = None``) so the optimizer leaves every parameter and its state untouched. The
same flag on every rank means the same skipped step everywhere: no rank runs ahead, none hangs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dist.collectives import Communicator
from lightning_dist.compression.packing import all_finite

logger = logging.getLogger(__name__)


def local_grads_finite(optimizer: Any) -> bool:
    """Whether every gradient this rank holds for ``optimizer``'s parameters is finite."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(all_finite(*grads))


class NonFiniteGuard:
    """Wraps an optimizer step's closure; ``skipped`` counts the steps skipped so far."""

    def __init__(self) -> None:
        self.skipped = 0
        self.last_skipped = False

    def wrap(
        self, optimizer: Any, closure: Callable[[], Any], step: int, comm: Communicator
    ) -> Callable[[], Any]:
        """``closure`` followed by the check; the flag goes through ``comm`` (the strategy's)."""

        def guarded() -> Any:
            result = closure()
            flag = torch.tensor([0.0 if local_grads_finite(optimizer) else 1.0])
            self.last_skipped = bool(comm.all_reduce(flag, "max").item() > 0)
            if self.last_skipped:
                self.skipped += 1
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
                logger.debug("optimizer step %d skipped: non-finite gradients", step)
                rank_zero_warn(
                    f"skip_nonfinite: non-finite gradients on at least one rank at optimizer step {step}; "
                    f"the step was skipped on every rank ({self.skipped} so far)"
                )
            return result

        return guarded
