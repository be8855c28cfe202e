"""Which strategy a ``--strategy`` spec names, and how its ranks start: the class's ``launch_needs``.

A spec is a registered name (``ld_ddp``), a class name of the pack (``DiLoCo``) or
``lightning_dist:Class(keyword=literal, ...)``; a class is launched as its registered names are.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any, Union

from lightning_dist.strategies.launch_needs import ENGINES, LIGHTNING, LaunchNeeds

FORK_START_METHODS = ("spawn", "fork", "forkserver")


def _needs(cls: type, params: Mapping[str, Any]) -> Union[LaunchNeeds, str, None]:
    """The launch needs of ``cls`` built with ``params``, the reason it is refused, or None for a
    strategy that declares none (DeepSpeed, XLA ...); Lightning's own ``DDPStrategy`` starts as the
    pack's ``DDP`` does."""
    from lightning.pytorch.strategies import DDPStrategy

    needs = getattr(cls, "launch_needs", LIGHTNING if cls is DDPStrategy else None)
    if not isinstance(needs, LaunchNeeds):
        return None
    if needs.refused is not None:
        return needs.refused
    start = params.get("start_method", "popen")
    if needs.engine == "lightning" and start in FORK_START_METHODS:
        return (
            f"it starts its own processes (start_method={start!r}), but under SLURM srun starts "
            "one task per device; use 'ld_ddp' (or 'ddp' for Lightning's own)"
        )
    return needs


def _registry() -> tuple[dict[str, LaunchNeeds], dict[str, str]]:
    """Accepted registered names, and refused ones with the reason."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401  (registers lightning_dist's strategy names)
    from lightning_dist.strategies.registry import resolve

    launchable: dict[str, LaunchNeeds] = {}
    refused: dict[str, str] = {}
    for name in StrategyRegistry.available_strategies():
        cls, params = resolve(StrategyRegistry, name)
        needs = _needs(cls, params) if isinstance(cls, type) else None
        if isinstance(needs, str):
            refused[name] = needs
        elif needs is not None:
            launchable[name] = needs
    return launchable, refused


def class_needs() -> dict[str, Union[LaunchNeeds, str]]:
    """lightning_dist's strategy classes (``--strategy DDP`` or ``lightning_dist:DDP(...)``): how each
    starts its ranks, or why it is refused."""
    import lightning_dist.strategies as strategies

    out: dict[str, Union[LaunchNeeds, str]] = {}
    for name in strategies.STRATEGIES:
        needs = _needs(getattr(strategies, name), {})
        if needs is not None:
            out[name] = needs
    return out


def accepted_strategies() -> list[str]:
    """The names ``--strategy`` accepts (registered names and lightning_dist's class names)."""
    launchable, _ = _registry()
    return _ordered(launchable)


def _ordered(launchable: dict[str, LaunchNeeds]) -> list[str]:
    """Registered names by engine (``ENGINES``), then the class names."""
    order = {engine: i for i, engine in enumerate(ENGINES)}
    names = sorted(
        launchable, key=lambda n: (order[launchable[n].engine], not n.startswith(("ld_", "compressed_")), n)
    )
    classes = {c: k for c, k in class_needs().items() if isinstance(k, LaunchNeeds)}
    return names + sorted(classes, key=lambda c: (order[classes[c].engine], c))


def resolve_strategy(spec: str) -> LaunchNeeds:
    """How a registered name, a class name (``DDP``) or ``lightning_dist:Class(kw=...)`` starts its
    ranks; a ``ValueError`` for one that is refused or unknown."""
    launchable, refused = _registry()
    if spec in launchable:
        return launchable[spec]
    if spec in refused:
        raise ValueError(f"--strategy {spec!r} is refused under SLURM: {refused[spec]}")
    class_name, kwargs = spec, {}
    if ":" in spec:
        module, _, expr = spec.partition(":")
        try:
            call = ast.parse(expr if "(" in expr else expr + "()", mode="eval").body
            assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
            class_name = call.func.id
        except (SyntaxError, ValueError, AssertionError):
            class_name = ""
        if module.split(".")[0] != "lightning_dist":
            class_name = ""
    needs = class_needs().get(class_name)
    if isinstance(needs, str):
        raise ValueError(f"--strategy {spec!r} is refused under SLURM: {needs}")
    if needs is not None:
        if kwargs.get("start_method") in FORK_START_METHODS:
            raise ValueError(
                f"--strategy {spec!r}: start_method={kwargs['start_method']!r} starts its own processes, "
                "but under SLURM srun starts one task per device; leave start_method at 'auto' or 'popen'"
            )
        for keyword, value, why in needs.refused_options:
            if keyword in kwargs and kwargs[keyword] == value:
                raise ValueError(f"--strategy {spec!r}: {why}")
        return needs
    accepted = ", ".join(_ordered(launchable))
    raise ValueError(
        f"--strategy {spec!r} is not a strategy lightning-dist can launch; accepted: {accepted} "
        "(or 'lightning_dist:Class(keyword=literal, ...)')"
    )
