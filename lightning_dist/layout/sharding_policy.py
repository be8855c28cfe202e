"""Which modules ``Sharded`` shards: the user's ``fully_shard`` calls, or a default per-layer policy.

The default follows torchtitan: every block gets its own FSDP unit (so one block's full weights
exist at a time), then the model that holds them. A *block* is each entry of a ``ModuleList``,
``Sequential`` or ``ModuleDict`` (transformer layers), or any other child module with parameters
(embeddings, heads, norms); containers are looked into, not sharded, and a module holding one
(``nn.TransformerEncoder``) is sharded after its blocks. The root: the LightningModule
itself when it holds parameters of its own (they are gathered when its ``forward`` runs, so its
``training_step`` must call ``self(...)``), else each of its top-level children (Lightning calls
``training_step``, which need not call the LightningModule's ``forward``).

Tied parameters (one ``nn.Parameter`` held by several modules: a language model's input embedding
and output head) must be in one FSDP unit, or FSDP2 refuses them at the first forward. So a block
holding some but not all of a tied parameter's modules is not a unit of its own: the smallest unit
around all of them takes them (GPT-2's ``lm_head`` and ``transformer.wte`` go to the model that
holds both); where that is the LightningModule (both are its children), the LightningModule is a
unit, with the same rule as for its own parameters: its ``training_step`` must call ``self(...)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """The ``fully_shard``-ed modules under ``module`` (itself included), in ``modules()`` order;
    of the modules sharded together (``fully_shard([a, b])``: one FSDP state) only the first."""
    seen: set[int] = set()
    found: list[FSDPModule] = []
    for m in module.modules():
        if isinstance(m, FSDPModule) and id(m._get_fsdp_state()) not in seen:
            seen.add(id(m._get_fsdp_state()))
            found.append(m)
    return found


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_stack(module: nn.Module) -> bool:
    """A module holding a container of blocks (``nn.TransformerEncoder``'s ``layers``)."""
    return any(isinstance(c, CONTAINERS) for c in module.children())


def _blocks(module: nn.Module, units: list[nn.Module]) -> None:
    for child in module.children():
        if isinstance(child, CONTAINERS):
            _blocks(child, units)
        elif _has_parameters(child):
            if _is_stack(child):
                _blocks(child, units)
            units.append(child)


def candidate_units(root: nn.Module) -> list[nn.Module]:
    """The default policy's units for ``root`` (a LightningModule), blocks before what holds them,
    before tied parameters are taken into account."""
    units: list[nn.Module] = []
    if any(True for _ in root.parameters(recurse=False)):
        _blocks(root, units)
        units.append(root)
    else:
        for child in root.children():
            if not _has_parameters(child):
                continue
            _blocks(child, units)  # a container's entries are roots themselves
            if not isinstance(child, CONTAINERS):
                units.append(child)
    unique: dict[int, nn.Module] = {}  # a module registered twice (reused) is one unit
    for unit in units:
        unique.setdefault(id(unit), unit)
    return list(unique.values())


def tied_owners(root: nn.Module) -> list[set[int]]:
    """For each parameter that several modules under ``root`` hold: the ids of those modules."""
    owners: dict[int, set[int]] = {}
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
    return [o for o in owners.values() if len(o) > 1]


def plan_units(root: nn.Module) -> list[nn.Module]:
    """The FSDP units of the default policy for ``root``, in the order they are made: the candidate
    units that hold all or none of each tied parameter's modules, then, where a tied parameter's
    modules are left in no unit (top-level children of a root without parameters of its own),
    ``root`` itself, which takes them (FSDP2 needs a single root: no unit of two top-level modules)."""
    candidates = candidate_units(root)
    ties = tied_owners(root)
    inside = {id(u): {id(m) for m in u.modules()} for u in candidates}
    kept = [u for u in candidates if not any(o & inside[id(u)] and not o <= inside[id(u)] for o in ties)]
    covered = set().union(*(inside[id(u)] for u in kept))
    if any(not o <= covered for o in ties) and root not in kept:
        kept.append(root)
    return kept


def shard_by_layer(root: nn.Module, mesh: Any) -> list[FSDPModule]:
    """Apply the default policy (module docstring) to ``root`` (a LightningModule) over ``mesh``;
    returns the FSDP modules made."""
    for unit in plan_units(root):
        fully_shard(unit, mesh=mesh)
    return fsdp_modules(root)


def split_ties(root: nn.Module) -> list[list[str]]:
    """The parameters under ``root`` that FSDP2 manages in more than one unit, each as the names it has
    there: modules that shared one ``nn.Parameter`` and were ``fully_shard``-ed apart (FSDP2 refuses
    that at the first forward only when one root unit holds both units, and otherwise trains two
    independent copies)."""
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    units: dict[int, dict[int, list[str]]] = {}  # parameter uid -> unit (FSDP state) -> names
    for module in fsdp_modules(root):
        state = module._get_fsdp_state()
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                name = ".".join(n for n in (names.get(id(info.module), "?"), info.param_name) if n)
                units.setdefault(fsdp_param._orig_param_uid, {}).setdefault(id(state), []).append(name)
    return [
        [n for names in by_unit.values() for n in names] for by_unit in units.values() if len(by_unit) > 1
    ]


def unsharded_parameters(module: nn.Module) -> list[str]:
    """Names of trainable parameters no FSDP unit manages (plain tensors, not DTensors): their
    gradients would not be synchronised."""
    return [n for n, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
