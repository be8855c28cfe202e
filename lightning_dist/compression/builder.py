"""The one way a strategy turns its compressor argument into a ``Compressor``.

Every strategy takes a name (``"int8"``) or a ``Compressor`` instance, some of them only a subset
(DiLoCo: compressors that return an average; Horovod: all-reduce ones) and some with options
(``Compressed("powersgd", rank=4)``). ``build_compressor`` checks all of that in one place, with a
``ValueError`` that names the argument, what was given and what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_dist.compression.dense import NoCompression
from lightning_dist.compression.protocol import Compressor

__all__ = ["build_compressor"]


def build_compressor(
    value: Any,
    registry: Mapping[str, type[Compressor]],
    *,
    argument: str = "compressor",
    accepted: Optional[Sequence[Optional[str]]] = None,
    refusal: str = "",
    options: Optional[Mapping[str, Any]] = None,
    owner: str = "",
    strategy_options: Sequence[str] = (),
) -> Compressor:
    """``value`` (a ``Compressor`` instance, a name in ``registry`` or ``None`` for no compression
    when ``accepted`` names ``"none"``) as a ``Compressor``, built with ``options`` from a name.

    Args:
        registry: name -> compressor class (``compression.COMPRESSORS``).
        argument: the strategy's argument name, for the error (``"replica_sync"``).
        accepted: the names this strategy takes (default: every name of ``registry``); an instance is
            accepted when its ``name`` is one of them.
        refusal: why the others are refused (``" by DiLoCo (the pseudo-gradient needs an average)"``).
        options: the compressor's keyword options, for a name only.
        owner, strategy_options: who reports an unknown option and its own options, for the error.
    """
    names = list(registry) if accepted is None else [n for n in accepted if n is not None]
    if accepted is None:
        listed = f"{', '.join(names)} or a Compressor instance"
    else:
        listed = (
            "None, " if "none" in names else ""
        ) + f"{', '.join(map(repr, names))} or a Compressor of those"

    def refuse(known: bool) -> ValueError:
        verdict = f"is not supported{refusal}" if known or accepted is not None else "is not known"
        return ValueError(f"{argument}={value!r} {verdict}; accepted: {listed}")

    if value is None and "none" in names:
        return NoCompression()
    extra = ", ".join(strategy_options)
    if isinstance(value, Compressor):
        if value.name not in names:
            raise refuse(known=True)
        if options:
            raise ValueError(
                f"{owner} got unknown option(s) {', '.join(sorted(options))}; a Compressor instance takes "
                f"its options itself; strategy options: {extra}"
            )
        return value
    name = value.lower() if isinstance(value, str) else None
    if name not in names:
        raise refuse(known=name in registry)
    try:
        return registry[name](**(options or {}))
    except ValueError as err:
        if extra and "unknown option" in str(err):
            raise ValueError(f"{err}; strategy options: {extra}") from None
        raise
