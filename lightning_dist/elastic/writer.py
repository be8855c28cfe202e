"""Commits written in the background, so training goes on while a commit reaches the disk.

``BackgroundWriter.submit`` takes a snapshot (every tensor cloned, so later optimizer steps cannot
change what is written) and hands it to one writer thread; at most one commit is in flight, so
commits land in step order and a new ``submit`` first waits for the previous write. A failed write
is raised by the next ``submit``, ``wait`` or ``close``, never dropped. A process killed while a
write is in flight leaves only a temporary file (``CommitStore`` is atomic), so a restart resumes
from the previous commit. Pure Python + torch: no torch.distributed, no lightning.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_dist.elastic.commits import CommitStore


def snapshot(state: Any) -> Any:
    """A copy of ``state`` whose tensors are detached clones (containers copied, leaves shared)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, snapshot(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


class BackgroundWriter:
    """Writes commits of ``store`` on one background thread, one at a time, in submission order."""

    def __init__(self, store: CommitStore) -> None:
        self.store = store
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_path: Optional[Path] = None
        """The path of the newest commit known to be on disk."""

    def submit(self, step: int, state: dict[str, Any]) -> None:
        """Commit ``state`` as of ``step`` in the background (snapshotted now)."""
        self.wait()
        copy = snapshot(state)
        self._thread = threading.Thread(
            target=self._write, args=(step, copy), name=f"lightning_dist-commit-{step}", daemon=True
        )
        self._thread.start()

    def _write(self, step: int, state: dict[str, Any]) -> None:
        try:
            self.last_path = self.store.save(step, state)
        except BaseException as err:  # raised on the training thread by wait()
            self._error = err

    def wait(self) -> None:
        """Block until the commit in flight is on disk; raise its error if the write failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"Elastic: writing a commit to {self.store.dirpath} failed: {error}"
            ) from error

    close = wait
