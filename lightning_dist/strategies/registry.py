"""The pack's names in Lightning's ``StrategyRegistry``: one prefix, no overwriting, deprecated aliases.

Every name starts with ``ld_`` (``Trainer(strategy="ld_horovod_adasum")``). A name that another
package already registered is left to it, with a warning naming both. The bare names of the first
release (``horovod``, ``elastic``, ``compressed_int8``, ...) still work for one release: they build
the same strategy and warn that they are deprecated.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from lightning_dist.warn import warn_once

PREFIX = "ld_"
DEPRECATED_SINCE = "0.2.0"


class DeprecatedName:
    """What a deprecated alias registers: builds the strategy of ``new`` and warns once."""

    def __init__(self, old: str, new: str, registry: Any) -> None:
        self.old, self.new, self.registry = old, new, registry
        self.warned = False

    def __call__(self, **init_params: Any) -> Any:
        if not self.warned:
            self.warned = True
            warn_once(
                f'lightning_dist: strategy="{self.old}" is deprecated since {DEPRECATED_SINCE} and will be '
                f'removed in the next release; use strategy="{self.new}" (same strategy, same options)',
                FutureWarning,  # shown by default: a deprecation aimed at users' code
            )
        entry = self.registry[self.new]
        return entry["strategy"](**{**entry["init_params"], **init_params})

    def __repr__(self) -> str:
        return f"DeprecatedName({self.old!r} -> {self.new!r})"


class LazyStrategy:
    """What a name registers while its strategy's module is not imported yet: Lightning calls it as it
    would the class (``registry.get(name)``), and it imports the class then. Importing the module
    puts the class itself in its place (``strategies/names.py``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        """``module.Class``: ``"lightning_dist.strategies.ddp.DDP"``."""

    def load(self) -> type:
        module, _, name = self.path.rpartition(".")
        cls: type = getattr(importlib.import_module(module), name)
        return cls

    def __call__(self, **init_params: Any) -> Any:
        return self.load()(**init_params)

    def __repr__(self) -> str:
        return f"LazyStrategy({self.path!r})"


def _owner(entry: dict[str, Any]) -> str:
    target = entry.get("strategy")
    if isinstance(target, DeprecatedName):
        return "lightning_dist"
    if isinstance(target, LazyStrategy):
        return target.path
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _is_ours(entry: dict[str, Any]) -> bool:
    return _owner(entry).startswith("lightning_dist.") or _owner(entry) == "lightning_dist"


def _put(registry: Any, name: str, target: Callable[..., Any], description: str, **init_params: Any) -> bool:
    if name in registry and not _is_ours(registry[name]):
        warn_once(
            f"lightning_dist: the strategy name {name!r} is already registered by {_owner(registry[name])}; "
            f"lightning_dist leaves it to that package (use lightning_dist's own name or class instead)"
        )
        return False
    registry.register(name, target, description=description, override=True, **init_params)
    return True


def register(
    registry: Any, name: str, cls: type, description: str, deprecated: str = "", **init_params: Any
) -> bool:
    """Register ``cls`` as ``name`` (which must start with ``ld_``), and ``deprecated`` as an alias.
    Returns whether ``name`` was registered (False: another package holds it)."""
    if not name.startswith(PREFIX):
        raise ValueError(f"strategy name {name!r} must start with {PREFIX!r}")
    done = _put(registry, name, cls, description, **init_params)
    if done and deprecated:
        _put(registry, deprecated, DeprecatedName(deprecated, name, registry), f"deprecated: use {name!r}")
    return done


def resolve(registry: Any, name: str) -> tuple[Any, dict[str, Any]]:
    """The class (or factory) and init params that ``registry.get(name)`` calls, a deprecated alias
    followed to the name it stands for (a class not imported yet is imported)."""
    entry = registry[name]
    target = entry["strategy"]
    if isinstance(target, DeprecatedName):
        return resolve(registry, target.new)
    if isinstance(target, LazyStrategy):
        target = target.load()
    return target, dict(entry.get("init_params", {}))


def check_name(registry: Any, name: str) -> None:
    """A ``ValueError`` for an ``ld_`` name ``registry`` does not hold, naming the pack's closest names
    and ``lightning-dist strategies``; other names pass (Lightning judges them). For the pack's own
    entry points: ``Trainer(strategy="ld_...")`` itself raises Lightning's message, which lists
    Lightning's names only (it checks a list of the registry's keys, with no hook before it raises)."""
    key = name.lower()
    if not key.startswith(PREFIX) or key in registry:
        return
    ours = [n for n in pack_names(registry) if n.startswith(PREFIX)]
    close = difflib.get_close_matches(key, ours, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    raise ValueError(
        f"strategy={name!r} is not a name lightning_dist registers{hint}; `lightning-dist strategies` "
        "lists every ld_ name with what it builds"
    )


def pack_names(registry: Any) -> dict[str, str]:
    """Every name the pack registered in ``registry`` with its description, deprecated aliases last."""
    ours = {name: entry for name, entry in registry.items() if _is_ours(entry)}
    current = sorted(n for n, e in ours.items() if not isinstance(e["strategy"], DeprecatedName))
    old = sorted(n for n, e in ours.items() if isinstance(e["strategy"], DeprecatedName))
    return {name: ours[name]["description"] for name in current + old}
