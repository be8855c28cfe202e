"""The wire model: bytes one rank sends per collective, as the collectives layer counts them.

With N payload bytes and W ranks:
  all-reduce   2*(W-1)*N // W   (ring: reduce-scatter then all-gather)
  all-gather   (W-1)*N
  all-to-all   (W-1)*N // W     (the payload split in W equal rows, one per rank)
Every formula is 0 at world size 1: a single process sends nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = Sequence[int]


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` (reduce-scatter then all-gather)."""
    return 0 if world_size <= 1 else 2 * (world_size - 1) * nbytes // world_size


def all_gather_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all-gather of an ``nbytes`` payload."""
    return 0 if world_size <= 1 else (world_size - 1) * nbytes


def all_to_all_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all-to-all of an ``nbytes`` payload split in W equal rows."""
    return 0 if world_size <= 1 else (world_size - 1) * nbytes // world_size


def total_numel(shapes: Sequence[Shape]) -> int:
    """Elements in tensors of these shapes."""
    return sum(math.prod(s) for s in shapes)


def reference_bytes(shapes: Sequence[Shape], world_size: int) -> int:
    """The baseline: bytes one rank sends in a ring all-reduce of these tensors in fp32."""
    return ring_all_reduce_bytes(4 * total_numel(shapes), world_size)
