"""Text every machine has: the running interpreter's standard-library ``.py`` files, as bytes.

Files are listed in sorted order (site-packages and caches pruned) and split by a CRC of their
relative path, so the train/validation split is the same on every rank and every run of the same
Python.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils.data import Dataset
from typing_extensions import override

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


@lru_cache(maxsize=1)
def stdlib_sources() -> tuple[str, ...]:
    """Relative paths of the standard library's ``.py`` files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py"))
    return tuple(sorted(found))


def is_validation_file(relpath: str, val_percent: int = 10) -> bool:
    return zlib.crc32(relpath.encode()) % 100 < val_percent


def load_corpus(split: str, max_bytes: int) -> torch.Tensor:
    """Concatenated bytes of the ``split`` ("train" or "val") files, at most ``max_bytes``."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}; accepted: 'train', 'val'")
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for rel in stdlib_sources():
        if is_validation_file(rel) != (split == "val"):
            continue
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.long)


@dataclass(frozen=True)
class TextBlocks(Dataset):
    """Non-overlapping (input, target) windows of ``seq_len`` tokens over a byte stream."""

    tokens: torch.Tensor
    seq_len: int

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    @override
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]
