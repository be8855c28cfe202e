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


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``: a DTensor's local shard, any other tensor whole."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


class StateBytes(L.Callback):
    """Bytes this rank holds for training, at the last optimizer step (gradients still there):
        parameters, gradients and optimizer state (each DTensor counted by its local shard), and the
        strategy's own per-rank copies (DiLoCo's last-sync parameters and outer momentum, the latter
    counted from the start: it exists from the first sync on)."""

    def __init__(self) -> None:
        self.params = self.grads = self.optimizer = self.strategy = 0

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = list(pl_module.parameters())
        self.params = sum(_local_bytes(p) for p in params)
        self.grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
        self.optimizer = sum(
            _local_bytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )
        outer = getattr(trainer.strategy, "outer", None)
        if outer is not None:  # the momentum, made at the first sync, is as large as the anchors
            copies = 2 if getattr(trainer.strategy, "outer_momentum", 0) > 0 else 1
            self.strategy = copies * sum(_local_bytes(a) for a in outer.anchors)

    def summary(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "strategy": self.strategy,
        }
