"""Per-step monitoring: step time, bytes on the wire, comm time and throughput from ``collectives``."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_dist import collectives


class CommMonitor(L.Callback):
    """Records and logs, per training batch: wall time, bytes sent/received, seconds in collectives,
    and the (rank-local) loss.

    ``summary()`` gives medians over the steps after ``warmup`` (rank-local values).
    """

    def __init__(self, warmup: int = 3, log: bool = True) -> None:
        self.warmup = warmup
        self.log = log
        self.step_seconds: list[float] = []
        self.bytes_sent: list[int] = []
        self.bytes_received: list[int] = []
        self.comm_seconds: list[float] = []
        self.samples: list[int] = []
        self.losses: list[float] = []
        self._start = 0.0
        self._base: dict[str, float] = {}

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        self._base = collectives.stats().snapshot()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = collectives.stats().snapshot()
        elapsed = time.perf_counter() - self._start
        sent = int(now["bytes_sent"] - self._base.get("bytes_sent", 0))
        received = int(now["bytes_received"] - self._base.get("bytes_received", 0))
        comm = now["seconds"] - self._base.get("seconds", 0.0)
        self.step_seconds.append(elapsed)
        self.bytes_sent.append(sent)
        self.bytes_received.append(received)
        self.comm_seconds.append(comm)
        n = len(batch[0]) if isinstance(batch, (list, tuple)) else 0
        self.samples.append(n)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))
        if self.log:
            pl_module.log_dict(
                {"comm/bytes_sent": float(sent), "comm/seconds": comm, "perf/step_seconds": elapsed},
                on_step=True,
                on_epoch=False,
                sync_dist=False,
            )

    def summary(self) -> dict[str, float]:
        steps = self.step_seconds[self.warmup :] or self.step_seconds
        sent = self.bytes_sent[self.warmup :] or self.bytes_sent
        comm = self.comm_seconds[self.warmup :] or self.comm_seconds
        return {
            "steps": len(self.step_seconds),
            "median_step_s": statistics.median(steps) if steps else float("nan"),
            "bytes_sent_per_step": statistics.median(sent) if sent else 0.0,
            "comm_s_per_step": statistics.median(comm) if comm else 0.0,
        }
