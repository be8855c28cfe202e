"""Argument checks shared by compressors and strategies.

Bad input fails early with a ``ValueError`` that names the argument, its value and what is accepted
(``bucket_cap_mb=0 must be a number > 0``). An ``owner`` prefixes the message with who asked
(``powersgd: rank=0 must be an integer >= 1``), for options that reach an object through a factory.
Pure Python: nothing here imports torch, torch.distributed or lightning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any, NoReturn, Optional, TypeVar

C = TypeVar("C")


def _fail(owner: str, name: str, value: Any, requirement: str) -> NoReturn:
    prefix = f"{owner}: " if owner else ""
    raise ValueError(f"{prefix}{name}={value!r} {requirement}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounds(low: float, high: Optional[float], low_open: bool, high_open: bool = False) -> str:
    """``>= 1``, ``> 0``, ``in [1, 64]``, ``in (0, 1]`` or ``in [0, 1)``."""
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_int(name: str, value: Any, low: int, high: Optional[int] = None, *, owner: str = "") -> None:
    """An int (not a bool) in ``[low, high]`` (no upper bound when ``high`` is None)."""
    if not (_is_int(value) and low <= value and (high is None or value <= high)):
        _fail(owner, name, value, f"must be an integer {_bounds(low, high, False)}")


def check_number(
    name: str,
    value: Any,
    low: float,
    high: Optional[float] = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    owner: str = "",
) -> None:
    """An int or float (not a bool, not nan) >= ``low`` (> when ``low_open``) and <= ``high`` (<
    when ``high_open``)."""
    above = _is_real(value) and (value > low if low_open else value >= low)
    if not (above and (high is None or (value < high if high_open else value <= high))):
        bounds = _bounds(low, high, low_open, high_open)
        _fail(owner, name, value, f"must be a number {bounds}" if high is None else f"must be {bounds}")


def check_positive(name: str, value: Any, *, owner: str = "") -> None:
    """A number > 0."""
    check_number(name, value, 0, low_open=True, owner=owner)


def check_multiple(name: str, value: Any, factor: int, *, owner: str = "") -> None:
    """A positive int that ``factor`` divides."""
    if not (_is_int(value) and value >= factor and value % factor == 0):
        _fail(owner, name, value, f"must be a positive multiple of {factor}")


def check_bool(name: str, value: Any, *, owner: str = "") -> None:
    """True or False (not 0, 1 or None)."""
    if not isinstance(value, bool):
        _fail(owner, name, value, "must be True or False")


def check_choice(name: str, value: Any, accepted: Iterable[Any], *, owner: str = "") -> None:
    """One of ``accepted`` (compared with ``in``)."""
    accepted = tuple(accepted)
    if value not in accepted:
        _fail(owner, name, value, f"is not supported; accepted: {', '.join(map(repr, accepted))}")


def reject_unknown_options(owner: str, unknown: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """Fail on leftover keyword arguments, naming all of them and the accepted ones."""
    if unknown:
        names = ", ".join(sorted(unknown))
        raise ValueError(f"{owner} got unknown option(s) {names}; accepted: {', '.join(accepted)}")


def build_config(owner: str, config_cls: type[C], config: Optional[C], options: Mapping[str, Any]) -> C:
    """``config`` as given, or ``config_cls(**options)`` (a dataclass whose ``__post_init__`` checks).

    Fails on both at once, on a config of another class, and on an option that is not a field of
    ``config_cls`` (naming the first unknown one and the accepted fields).
    """
    if config is not None:
        if options:
            raise ValueError(f"{owner}: pass either a config or options, not both")
        if not isinstance(config, config_cls):
            raise ValueError(f"{owner}: config must be a {config_cls.__name__}, got {type(config).__name__}")
        return config
    assert is_dataclass(config_cls), f"{config_cls.__name__} must be a dataclass"
    accepted = [f.name for f in fields(config_cls)]
    for name in options:
        if name not in accepted:
            raise ValueError(
                f"{owner}: unknown option {name!r}; accepted: {', '.join(accepted) if accepted else 'none'}"
            )
    return config_cls(**options)
