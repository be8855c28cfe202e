"""Run a function once a module has been imported, without importing it: now if it already is, else
right after it is loaded (a meta-path finder that wraps that one module's loader).

The package root uses it so that ``import lightning_dist`` never loads Lightning, yet the pack's
strategy names are in Lightning's ``StrategyRegistry`` whenever Lightning is (whichever of the two
is imported first). Pure Python.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional

__all__ = ["when_imported"]

Callback = Callable[[ModuleType], None]

_waiting: dict[str, list[Callback]] = {}
"""Module name -> what runs once it is loaded (removed when they have run)."""
_lock = threading.RLock()


def _loaded(name: str) -> Optional[ModuleType]:
    """``sys.modules[name]`` once its code has run (not while it is still being imported)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` for module ``name``: now when it is imported already, else as soon as
    its code has run. Exceptions from ``callback`` propagate to whoever imported the module."""
    module = _loaded(name)
    if module is not None:
        callback(module)
        return
    with _lock:
        _waiting.setdefault(name, []).append(callback)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def _run(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
        if not _waiting:
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    for callback in callbacks:
        callback(module)


class _Finder(MetaPathFinder):
    """Finds nothing itself: for a waited-for module it asks the other finders for the spec and wraps
    that spec's loader so the callbacks run after the module's code."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader: Any = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # no loader object of its own (a built-in or frozen module): not wrapped
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _run(fullname, module)

        loader.exec_module = exec_module  # this spec's own loader object: only this module is affected
        return spec
