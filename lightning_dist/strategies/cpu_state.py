"""Checkpoint state moved to the CPU, so a gathered or saved entry holds no device tensors."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def to_cpu(tree: Any) -> Any:
    """``tree`` with every tensor detached and on the CPU (dicts, lists and tuples walked)."""
    if isinstance(tree, Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree
