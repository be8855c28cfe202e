"""The sharded layout's distributed checkpoint (torch DCP): each rank's own state as one entry of its own.

``CHECKPOINT_KEY.rank<r>`` holds rank r's state as opaque bytes (written by that rank only, whatever
its structure) beside the model and optimizer entries, and is read back by the same rank at the same
layout. With a group of its own (``async_save``) the files are written in the background.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp

CHECKPOINT_KEY = "lightning_dist.sharded"
"""In the checkpoint's metadata: ``{"world_size": W, "replicas": R}``; in the distributed checkpoint,
``CHECKPOINT_KEY.rank<r>`` holds rank r's per-rank state."""


def rank_key(rank: int) -> str:
    return f"{CHECKPOINT_KEY}.rank{rank}"


def as_bytes(state: Any) -> io.BytesIO:
    """``state`` as one opaque entry of a distributed checkpoint (DCP loads it back as the object)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def from_bytes(value: Any) -> Any:
    """The state ``as_bytes`` wrote (DCP hands it back as a ``BytesIO``)."""
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=True)
    return value


class ShardedCheckpoints:
    """Writes and reads the distributed checkpoint of one rank; at most one write in the background."""

    def __init__(self) -> None:
        self.group: Optional[Any] = None
        """The process group of background writes (``async_save``), or None: written at once."""
        self._pending: Optional[Any] = None

    def save(
        self, checkpoint: dict[str, Any], path: Path, rank: int, rank_state: Any, background: bool
    ) -> None:
        """Move ``checkpoint``'s model and optimizer states, with ``rank_state``, into DCP files at
        ``path`` (a directory); in the background when ``background`` and a group is set."""
        converted: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            converted[f"optimizer_{idx}"] = optim_state
        converted[rank_key(rank)] = as_bytes(rank_state)
        self.wait()
        if self.group is not None and background:
            self._pending = dcp.async_save(converted, checkpoint_id=path, process_group=self.group)
        else:
            dcp.save(converted, checkpoint_id=path)

    def wait(self) -> None:
        """Until the checkpoint being written in the background, if any, is complete."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @staticmethod
    def load_rank_state(path: Path, rank: int) -> Any:
        """What rank ``rank`` saved of its own state in the distributed checkpoint at ``path``."""
        loaded: dict[str, Any] = {rank_key(rank): io.BytesIO()}  # DCP fills it with the saved bytes
        dcp.load(loaded, checkpoint_id=path)
        return from_bytes(loaded[rank_key(rank)])
