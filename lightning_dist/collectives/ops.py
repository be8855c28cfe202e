"""Reduction ops: one vocabulary for the whole pack (collectives, DDP's ``reduce_op``, Horovod's ``op``,
Lightning's ``reduce``).

Each op has one name (``"avg"``, ``"sum"``, ``"min"``, ``"max"``, ``"adasum"``); the other spellings
users bring are accepted everywhere and mean the same op: ``"mean"`` and ``"average"`` (Lightning,
Horovod), ``"add"``, any case, and torch's ``ReduceOp.SUM``/``AVG``/``MIN``/``MAX``. A caller names
the argument and the ops it supports, and gets the op's name or a ``ValueError`` naming both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, Optional

__all__ = ["ALIASES", "REDUCE_OPS", "ReduceOp", "check_reduce_op", "normalize_op", "op_name"]

ReduceOp = Literal["sum", "avg", "min", "max", "adasum"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "min", "max", "adasum")
"""Every op's name, as the collectives take it."""
ALIASES: dict[str, str] = {"mean": "avg", "average": "avg", "add": "sum", "redop_sum": "sum"}
"""Other spellings (lower case) -> the op's name. torch's ``ReduceOp.SUM`` reads as ``"sum"``."""


def normalize_op(op: Any) -> str:
    """The op's name for any of its spellings (``"Mean"`` -> ``"avg"``, ``ReduceOp.SUM`` -> ``"sum"``);
    anything else comes back as lower-case text, unchecked (``op_name`` checks)."""
    name = getattr(op, "name", None)  # torch's ReduceOp.RedOpType members (an enum)
    text = (name if isinstance(name, str) else str(op)).lower().split(".")[-1]
    return ALIASES.get(text, text)


def _other_spellings(accepted: Iterable[str]) -> str:
    """`` (also 'mean' or 'average' for 'avg'; torch.distributed.ReduceOp members)`` for ``accepted``."""
    spellings = [
        f"{' or '.join(repr(a) for a, target in ALIASES.items() if target == op and a != 'redop_sum')} for {op!r}"
        for op in accepted
        if any(target == op for target in ALIASES.values())
    ]
    torch_ops = [op.upper() for op in accepted if op != "adasum"]
    if torch_ops:
        spellings.append(f"torch.distributed.ReduceOp.{'/'.join(torch_ops)}")
    return f" (also {'; '.join(spellings)})" if spellings else ""


def op_name(
    op: Any, accepted: Iterable[str] = REDUCE_OPS, *, argument: str = "op", default: Optional[str] = None
) -> str:
    """The name of op ``op`` (any spelling above); ``None`` means ``default`` where one is given.

    Raises ``ValueError`` naming ``argument``, ``op`` and the ``accepted`` ops (with their other
    spellings) when ``op`` is none of ``accepted``.
    """
    accepted = tuple(accepted)
    assert set(accepted) <= set(REDUCE_OPS), accepted
    if op is None and default is not None:
        return default
    name = normalize_op(op)
    if name not in accepted:
        raise ValueError(
            f"{argument}={op!r} is not supported; accepted: {', '.join(map(repr, accepted))}"
            + _other_spellings(accepted)
        )
    return name


def check_reduce_op(op: Any) -> str:
    """The collectives' check: ``op_name(op)`` over every op."""
    return op_name(op)
