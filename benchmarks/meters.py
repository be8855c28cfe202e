"""What the benchmarks measure during ``fit``, as Lightning callbacks, and their workload model.

Imported by the benchmark scripts (``benchmarks/`` is on ``sys.path`` when a benchmark runs).
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_dist.workload import TinyCausalLM


def _bytes_sent(trainer: L.Trainer) -> int:
    """What the strategy's communicator has sent so far: a lightning_dist strategy's counters; 0 for
    a strategy without one (one process: Lightning's single-device strategy sends nothing)."""
    comm = getattr(trainer.strategy, "communicator", None)
    return 0 if comm is None else int(comm.stats.bytes_sent)


class PlainSgdOption(TinyCausalLM):
    """The workload with its own optimizer, or plain SGD at the same lr (for DeMo rows: DeMo keeps
    the momentum and returns a sign update)."""

    def __init__(self, plain_sgd: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plain_sgd = plain_sgd

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.plain_sgd:
            return torch.optim.SGD(self.parameters(), lr=self.config.lr)
        return super().configure_optimizers()


class GradBytes(L.Callback):
    """Bytes the gradient exchange sent per step (they all cross during backward)."""

    def __init__(self) -> None:
        self.grad_bytes: list[int] = []
        self._before = 0

    @override
    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self._before = _bytes_sent(trainer)

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.grad_bytes.append(_bytes_sent(trainer) - self._before)


class StepMeter(L.Callback):
    """Wall time and bytes sent per training step, from batch start to batch end."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.step_bytes: list[int] = []
        self._start = 0.0
        self._sent = 0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        self._start = time.perf_counter()
        self._sent = _bytes_sent(trainer)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.step_seconds.append(time.perf_counter() - self._start)
        self.step_bytes.append(_bytes_sent(trainer) - self._sent)
