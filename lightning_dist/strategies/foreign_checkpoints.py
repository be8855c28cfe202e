"""Checkpoints another strategy of the pack wrote, as a ``DDP``-family strategy resumes them.

- ``Sharded`` writes a torch distributed checkpoint (DCP): a directory of shards, a ``.metadata``
  index and Lightning's ``meta.pt`` (loops, callbacks, schedulers). ``load_distributed_checkpoint``
  reads it into one full Lightning checkpoint on each rank, without a process group (DCP's own
  conversion, as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does, in memory): the
  full state dict, the optimizer states re-keyed from parameter names to torch's parameter indices,
  and the metadata. Sharded's per-rank state (error-feedback residuals, replica-sync state) has no
  place in a replicated run: it is dropped, with a warning when it held anything.
- ``Compressed`` writes every rank's compressor state; a strategy that does not compress drops it,
  with the warning a resume that switches compressors gives (``warn_dropped_compressor_state``).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

import torch

from lightning_dist.compat import _METADATA_FILENAME
from lightning_dist.warn import warn_once

logger = logging.getLogger(__name__)

SHARDED_KEY = "lightning_dist.sharded"
"""``Sharded``'s entries: its layout in ``meta.pt``, ``<key>.rank<r>`` in the distributed checkpoint."""
COMPRESSED_KEY = "lightning_dist.compressed"
"""``Compressed``'s entry: every rank's compressor state (``strategies/compressed.py``)."""
DCP_INDEX = ".metadata"
"""The file every torch distributed checkpoint directory has."""


def is_distributed_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a torch distributed checkpoint directory."""
    return path.is_dir() and (path / DCP_INDEX).is_file()


def _read_full_state(path: Path) -> dict[str, Any]:
    """Every entry of the distributed checkpoint at ``path``, as full (unsharded) CPU tensors: what
    torch's ``dcp_to_torch_save`` loads before it writes its file (its planner and loader), kept in
    memory instead of written to a temporary file on every rank."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = FileSystemReader(path)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def optimizer_state_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (``get_optimizer_state_dict``, as ``Sharded`` saves
    it) keyed by parameter indices instead, as ``Optimizer.state_dict()`` has it: the indices count
    the parameters group by group in the order the groups list them, as torch numbers them."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    by_index = {index[name]: value for name, value in state["state"].items()}
    return {"state": dict(sorted(by_index.items())), "param_groups": groups}


def _held_rank_state(entries: list[Any]) -> list[str]:
    """What Sharded's per-rank entries held (in words, as the pieces' ``words`` say), or ``[]``."""
    held: set[str] = set()
    for entry in entries:
        raw = entry.getvalue() if isinstance(entry, io.BytesIO) else entry
        state = torch.load(io.BytesIO(raw), weights_only=True) if isinstance(raw, bytes) else raw
        for key, value in dict(state).items():
            if key == "replica_sync":
                if value.get("keys"):
                    held.add("replica-sync compressor state")
            elif key == "residuals":
                held.add("error-feedback residuals")
            elif value:
                held.add(key)
    return sorted(held)


def load_distributed_checkpoint(
    path: Path, owner: str, load_file: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """The Lightning checkpoint a ``Sharded`` (or Lightning ``ModelParallelStrategy``) run wrote as a
    distributed checkpoint at ``path``, whole, for a replicated strategy ``owner`` to resume from.
    ``load_file`` reads Lightning's metadata file (the strategy's ``CheckpointIO``)."""
    if not is_distributed_checkpoint(path):
        raise ValueError(
            f"{owner}: ckpt_path={str(path)!r} is a directory but not a torch distributed checkpoint (no "
            f"{DCP_INDEX} in it); pass a checkpoint file (.ckpt) or the directory Sharded() or "
            "ModelParallelStrategy wrote"
        )
    if not (path / _METADATA_FILENAME).is_file():
        raise ValueError(
            f"{owner}: ckpt_path={str(path)!r} is a torch distributed checkpoint that has no "
            f"{_METADATA_FILENAME}: not a Lightning checkpoint (no loops, no optimizer layout); load it with "
            "torch.distributed.checkpoint.load into your own state dict"
        )
    checkpoint = dict(load_file(path / _METADATA_FILENAME))
    full = _read_full_state(path)
    checkpoint["state_dict"] = full.pop("state_dict")
    count = len([k for k in full if k.startswith("optimizer_")])
    checkpoint["optimizer_states"] = [
        optimizer_state_by_index(full.pop(f"optimizer_{i}")) for i in range(count)
    ]
    rank_entries = [full.pop(k) for k in sorted(full) if k.startswith(f"{SHARDED_KEY}.rank")]
    held = _held_rank_state(rank_entries)
    if held:
        warn_once(
            f"{owner}: the checkpoint is Sharded()'s (a distributed checkpoint of "
            f"{len(rank_entries)} ranks); its per-rank state ({', '.join(held)}) has no place in a "
            f"replicated run and is dropped; resume with Sharded() to keep it",
            stacklevel=3,
        )
    logger.info(
        "%s: loaded the distributed checkpoint %s as one full checkpoint (%d tensors, %d optimizer(s))",
        owner,
        path,
        len(checkpoint["state_dict"]),
        count,
    )
    return checkpoint


def full_checkpoint(path: Union[str, Path]) -> dict[str, Any]:
    """The Lightning checkpoint in the distributed checkpoint folder ``path``, whole, in one process:
    ``torch.save(full_checkpoint(folder), "full.ckpt")`` writes a file every strategy resumes from
    (Lightning's own refuse a folder)."""
    return load_distributed_checkpoint(
        Path(path), "full_checkpoint", lambda meta: torch.load(meta, map_location="cpu", weights_only=False)
    )


def warn_dropped_compressor_state(checkpoint: Mapping[str, Any], owner: str) -> None:
    """Warn (once, rank 0) when ``checkpoint`` holds ``Compressed``'s compressor state, which ``owner``,
    a strategy that does not compress, drops (as ``Compressed`` warns when the compressor changes)."""
    saved = checkpoint.get(COMPRESSED_KEY)
    if not isinstance(saved, Mapping):
        return
    if not any(r.get("state", {}).get("keys") for r in saved.get("ranks", ())):
        return  # a compressor that keeps no state (fp16, bf16): nothing is lost
    name = saved.get("compressor")
    warn_once(
        f"{owner}: the checkpoint's compressor is {name!r}, and {owner} compresses nothing; the "
        f"compressor state of its {len(saved.get('ranks', ()))} ranks (error-feedback residuals, "
        f"warm-start factors) is dropped; resume with Compressed({name!r}) to keep it",
        stacklevel=3,
    )
