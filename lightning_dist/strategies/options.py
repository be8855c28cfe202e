"""Argument checks shared by the strategies: a ValueError that names the argument and the accepted values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check_choice(name: str, value: Any, accepted: Iterable[Any]) -> None:
    accepted = tuple(accepted)
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not supported; accepted: {', '.join(map(repr, accepted))}")


def check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a number > 0")


def reject_unknown_options(owner: str, unknown: dict[str, Any], accepted: Iterable[str]) -> None:
    if unknown:
        names = ", ".join(sorted(unknown))
        raise ValueError(f"{owner} got unknown option(s) {names}; accepted: {', '.join(accepted)}")


def reduce_op_name(name: str, op: Any, accepted: Iterable[str]) -> str:
    """Map Lightning/torch spellings (``"mean"``, ``ReduceOp.SUM``) to collectives' op names."""
    text = str(op).lower().split(".")[-1] if op is not None else "avg"
    text = {"mean": "avg", "average": "avg", "redop_sum": "sum"}.get(text, text)
    accepted = tuple(accepted)
    if text not in accepted:
        raise ValueError(f"{name}={op!r} is not supported; accepted: {', '.join(map(repr, accepted))}")
    return text
