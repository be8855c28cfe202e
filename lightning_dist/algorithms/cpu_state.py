"""Checkpoint state moved to the CPU, so a gathered or saved entry holds no device tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor


def map_tensors(tree: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``tree`` with ``fn`` applied to every tensor (dicts, lists and tuples walked, the rest kept)."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


def to_cpu(tree: Any) -> Any:
    """``tree`` with every tensor detached and on the CPU."""
    return map_tensors(tree, lambda t: t.detach().cpu())
