"""Make torchmetrics sync through ``collectives`` (its default looks only at torch.distributed)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from lightning_dist import collectives


def _gather(tensor: Tensor, group: Optional[Any] = None) -> list[Tensor]:
    return collectives.all_gather(tensor.contiguous())


def _available() -> bool:
    return collectives.current().world_size > 1


def route_metric_sync(module: nn.Module) -> int:
    """Point every torchmetrics ``Metric`` in ``module`` at collectives; returns how many."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return 0
    count = 0
    for m in module.modules():
        if isinstance(m, Metric):
            m.dist_sync_fn = _gather
            m.distributed_available_fn = _available
            count += 1
    return count
