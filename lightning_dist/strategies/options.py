"""Argument checks for the strategies: the shared ones from ``lightning_dist.checks``, plus op names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_dist.checks import check_bool, check_choice, check_positive, reject_unknown_options

__all__ = ["check_bool", "check_choice", "check_positive", "reduce_op_name", "reject_unknown_options"]


def reduce_op_name(name: str, op: Any, accepted: Iterable[str]) -> str:
    """Map Lightning/torch spellings (``"mean"``, ``ReduceOp.SUM``) to collectives' op names."""
    text = str(op).lower().split(".")[-1] if op is not None else "avg"
    text = {"mean": "avg", "average": "avg", "redop_sum": "sum"}.get(text, text)
    accepted = tuple(accepted)
    if text not in accepted:
        raise ValueError(f"{name}={op!r} is not supported; accepted: {', '.join(map(repr, accepted))}")
    return text
