"""Make torchmetrics sync through the strategy's communicator (its default looks only at
torch.distributed)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from lightning_dist.collectives import Communicator


class _MetricSync:
    """A metric's ``dist_sync_fn`` and ``distributed_available_fn`` over one communicator."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def gather(self, tensor: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        return self.comm.all_gather(tensor.contiguous())

    def available(self) -> bool:
        return self.comm.world_size > 1


def route_metric_sync(module: nn.Module, comm: Communicator) -> int:
    """Point every torchmetrics ``Metric`` in ``module`` at ``comm``; returns how many."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return 0
    sync = _MetricSync(comm)
    count = 0
    for m in module.modules():
        if isinstance(m, Metric):
            m.dist_sync_fn = sync.gather
            m.distributed_available_fn = sync.available
            count += 1
    return count
