"""What a ``FaultTolerant`` benchmark worker writes for its driver (``bench_failure_rate``,
``bench_healing``): its PID per attempt, each committed step as it commits, the live transfer's
timings, weight snapshots at given steps, and a stop at the step the driver names.

Files in ``out`` (``g``: ``$REPLICA_GROUP_ID``, ``a``: torchrun's restart count):
``pid_<g>_<a>`` (the worker's PID, so the driver can SIGKILL it), ``steps_<g>_<a>.jsonl`` (one row
per committed step: step, t, participants, indices, group, attempt), ``marks_<g>_<a>.json``
(timestamps of the attempt's stages and of its checkpoint sends and receives), ``snap_<g>_<s>.pt``
(the weights once step ``s`` is committed, for ``s`` in ``snapshots``), ``final_<g>.pt`` (the weights
at the end of fit, with the step). The driver writes ``stop`` (a step): each group's fit ends there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested dict/list state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Recorder(L.Callback):
    """The worker's side of the driver protocol (module docstring)."""

    def __init__(
        self,
        out: Path,
        snapshots: Iterable[int] = (),
        started: float = 0.0,
        keep: Callable[[str], bool] = lambda name: True,
    ) -> None:
        """``keep``: which state-dict entries the saved weights hold (``bench_healing`` leaves out its
        large frozen buffer)."""
        self.out, self.keep = out, keep
        self.group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.snapshots = set(snapshots)
        self.written = 0
        self.stop_at: int | None = None
        self.marks: dict[str, Any] = {"started": started or time.time(), "sends": [], "receives": []}
        write_atomic(out / f"pid_{self.group}_{self.attempt}", str(os.getpid()))
        self.file = open(out / f"steps_{self.group}_{self.attempt}.jsonl", "a")  # noqa: SIM115

    def _write_marks(self) -> None:
        write_atomic(self.out / f"marks_{self.group}_{self.attempt}.json", json.dumps(self.marks))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Time the torchft checkpoint transport's sends (staged, served) and receives."""
        self.marks["train_start"] = time.time()
        transport = getattr(trainer.strategy, "transport", None)
        checkpoints = getattr(transport, "checkpoint_transport", None)
        if checkpoints is None:
            return
        send, recv = checkpoints.send_checkpoint, checkpoints.recv_checkpoint

        def timed_send(*args: Any, **kwargs: Any) -> Any:
            staged = time.time()  # the state (and its checksum) is built before the call
            result = send(*args, **kwargs)
            self.marks["sends"].append({"staged": staged, "allowed": time.time()})
            self._write_marks()
            return result

        def timed_recv(*args: Any, **kwargs: Any) -> Any:
            begin = time.time()
            state = recv(*args, **kwargs)
            self.marks["receives"].append({"begin": begin, "end": time.time(), "bytes": tensor_bytes(state)})
            self._write_marks()
            return state

        checkpoints.send_checkpoint, checkpoints.recv_checkpoint = timed_send, timed_recv

    def on_before_backward(self, trainer: L.Trainer, *rest: Any) -> None:
        if "first_backward" not in self.marks:  # after the first quorum (and heal)
            self.marks["first_backward"] = time.time()
            self._write_marks()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *rest: Any) -> None:
        strategy: Any = trainer.strategy
        now = time.time()
        for rec in strategy.committed[self.written :]:
            row = {"step": rec.step, "t": now, "participants": rec.participants, "indices": rec.indices,
                   "group": self.group, "attempt": self.attempt}  # fmt: skip
            self.file.write(json.dumps(row) + "\n")
            if rec.step + 1 in self.snapshots:
                torch.save(_weights(pl_module, self.keep), self.out / f"snap_{self.group}_{rec.step + 1}.pt")
        if len(strategy.committed) > self.written:
            self.file.flush()
        self.written = len(strategy.committed)
        self._stop(trainer)

    def _stop(self, trainer: L.Trainer) -> None:
        """End the fit at the step the driver wrote to ``stop`` (read once it is there)."""
        if self.stop_at is None and (self.out / "stop").exists():
            self.stop_at = int((self.out / "stop").read_text())
            trainer.fit_loop.epoch_loop.max_steps = max(self.stop_at, trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.marks["train_end"] = time.time()
        self._write_marks()
        final = {"step": trainer.global_step, "weights": _weights(pl_module, self.keep)}
        torch.save(final, self.out / f"final_{self.group}.pt")


def _weights(module: L.LightningModule, keep: Callable[[str], bool]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if keep(k)}
