"""Which tensors DiLoCo syncs, pure torch: the parameters the inner optimizer steps (each once, named,
with a clear error for a foreign one), the floating-point buffers, and tensors grouped by dtype."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn


def persistent_float_buffers(module: nn.Module) -> list[Tensor]:
    """Floating-point buffers that are part of the state dict (BatchNorm's running statistics)."""
    seen: set[int] = set()
    out: list[Tensor] = []
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if (
                buf is not None
                and buf.is_floating_point()
                and name not in mod._non_persistent_buffers_set
                and id(buf) not in seen
            ):
                seen.add(id(buf))
                out.append(buf)
    return out


def by_dtype(tensors: Sequence[Tensor]) -> dict[torch.dtype, list[int]]:
    """The indices of ``tensors`` by dtype, in order (one exchange or all-reduce per dtype)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _unregistered_name(module: nn.Module, param: Tensor) -> Optional[str]:
    """Where ``param`` sits in ``module`` outside its registered parameters: a plain tensor attribute
    (``"scale"``), or a module or tensor in a plain list, tuple or dict attribute (``"blocks[1].weight"``)."""
    for prefix, mod in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        for attr, value in vars(mod).items():
            if attr.startswith("_"):
                continue
            candidates = [(f"{dot}{attr}", value)]
            if isinstance(value, dict):
                candidates += [(f"{dot}{attr}[{k!r}]", v) for k, v in value.items()]
            elif isinstance(value, (list, tuple)):
                candidates += [(f"{dot}{attr}[{i}]", v) for i, v in enumerate(value)]
            for name, candidate in candidates:
                if candidate is param:
                    return name
                if isinstance(candidate, nn.Module):  # registered sub-modules are not in vars()
                    for sub, p in candidate.named_parameters():
                        if p is param:
                            return f"{name}.{sub}"
    return None


def foreign_parameter_message(
    module: nn.Module, param: Tensor, group_index: int, group: Mapping[str, Any]
) -> str:
    """What ``DiLoCo.setup`` raises for an optimizer parameter that is not one of ``module``'s: the
    parameter (shape, dtype, its name where the optimizer or the module has one) and the fix."""
    index = next(i for i, p in enumerate(group["params"]) if p is param)
    where = f"param_groups[{group_index}]['params'][{index}]"
    names = group.get("param_names")
    if isinstance(names, (list, tuple)) and index < len(names):
        where += f", named {names[index]!r} in the optimizer's param_names"
    attr = _unregistered_name(module, param)
    if attr is not None:
        where += f", the module's unregistered {attr!r} (a plain attribute, list or dict: not a parameter)"
    return (
        f"DiLoCo: the optimizer holds a parameter that is not one of the LightningModule's parameters "
        f"({where}; shape {tuple(param.shape)}, dtype {param.dtype}). DiLoCo averages and checkpoints the "
        "module's parameters, so the inner optimizer must step only those: build it from self.parameters() "
        "(or self.named_parameters()) in configure_optimizers, and register sub-modules and tensors "
        "(nn.ModuleList/nn.ModuleDict, nn.Parameter) rather than keeping them in plain attributes."
    )


def inner_parameters(owner: str, module: nn.Module, optimizers: Sequence[Any]) -> list[tuple[str, Tensor]]:
    """(name, parameter) of every parameter the one (inner) optimizer steps, each once, in its order;
    a ValueError for several optimizers or a parameter that is not one of ``module``'s."""
    if len(optimizers) != 1:
        raise ValueError(
            f"{owner} needs exactly one optimizer (the inner one), configure_optimizers returned "
            f"{len(optimizers)}"
        )
    names = {id(p): n for n, p in module.named_parameters()}
    named: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for group_index, group in enumerate(optimizers[0].param_groups):
        for p in group["params"]:
            if id(p) in seen:
                continue
            if id(p) not in names:
                raise ValueError(foreign_parameter_message(module, p, group_index, group))
            seen.add(id(p))
            named.append((names[id(p)], p))
    return named
