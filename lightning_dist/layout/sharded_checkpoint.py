"""The sharded layout's distributed checkpoint (torch DCP): each rank's own state as one entry of its own.

``CHECKPOINT_KEY.rank<r>`` holds rank r's state as opaque bytes (written by that rank only, whatever
its structure) beside the model and optimizer entries, and is read back by the same rank at the same
layout. With a group of its own (``async_save``) the files are written in the background. Below:
this rank's part of sharded tensors and of an optimizer's state over them, for those entries.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.tensor import DTensor

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


def local_shard(param: Tensor) -> Tensor:
    """The tensor this rank holds of ``param``: a DTensor's local shard (an alias under ``no_grad``:
    writing it writes the parameter), any other tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


def like_param(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (this rank's part of something shaped and sharded like ``param``) as a DTensor
    placed like ``param``, so the distributed checkpoint saves it as one tensor and can reshard it."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def local_optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, by parameter name: local shards on the CPU."""
    out: dict[str, Any] = {}
    for param, state in optimizer.state.items():
        out[names[id(param)]] = {
            k: local_shard(v).detach().cpu().clone() if isinstance(v, Tensor) else v for k, v in state.items()
        }
    return out


def restore_local_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: Mapping[str, Any]
) -> None:
    """Write ``saved`` (``local_optimizer_state``'s) into ``optimizer``'s state in place: the state must
    exist (the distributed checkpoint's optimizer entry was loaded first) with the same entries."""
    have = {names[id(p)]: s for p, s in optimizer.state.items()}
    if set(have) != set(saved) or any(set(have[n]) != set(saved[n]) for n in saved):
        raise ValueError(
            f"ShardedDiLoCo: this rank's saved inner optimizer state holds {sorted(saved)[:5]}..., the "
            f"optimizer {sorted(have)[:5]}...: resume with the configure_optimizers of the run that saved it"
        )
    with torch.no_grad():
        for name, state in have.items():
            for k, v in state.items():
                if isinstance(v, Tensor):
                    local_shard(v).copy_(saved[name][k])
                else:
                    state[k] = saved[name][k]
