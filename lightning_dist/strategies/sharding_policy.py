"""Which modules ``Sharded`` shards: the user's ``fully_shard`` calls, or a default per-layer policy.

The default follows torchtitan: every block gets its own FSDP unit (so one block's full weights
exist at a time), then the model that holds them. A *block* is each entry of a ``ModuleList``,
``Sequential`` or ``ModuleDict`` (transformer layers), or any other child module with parameters
(embeddings, heads, norms); containers are looked into, not sharded, and a module holding one
(``nn.TransformerEncoder``) is sharded after its blocks. The root: the LightningModule
itself when it holds parameters of its own (they are gathered when its ``forward`` runs, so its
``training_step`` must call ``self(...)``), else each of its top-level children (Lightning calls
``training_step``, which need not call the LightningModule's ``forward``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """The ``fully_shard``-ed modules under ``module`` (itself included), in ``modules()`` order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _is_stack(module: nn.Module) -> bool:
    """A module holding a container of blocks (``nn.TransformerEncoder``'s ``layers``)."""
    return any(isinstance(c, CONTAINERS) for c in module.children())


def _shard_blocks(module: nn.Module, mesh: Any) -> None:
    for child in module.children():
        if isinstance(child, CONTAINERS):
            _shard_blocks(child, mesh)
        elif _has_parameters(child):
            if _is_stack(child):
                _shard_blocks(child, mesh)
            fully_shard(child, mesh=mesh)


def shard_by_layer(root: nn.Module, mesh: Any) -> list[FSDPModule]:
    """Apply the default policy (module docstring) to ``root`` (a LightningModule) over ``mesh``;
    returns the FSDP modules made."""
    if any(True for _ in root.parameters(recurse=False)):
        _shard_blocks(root, mesh)
        fully_shard(root, mesh=mesh)
        return fsdp_modules(root)
    for child in root.children():
        if not _has_parameters(child):
            continue
        _shard_blocks(child, mesh)  # a container's entries are roots themselves
        if not isinstance(child, CONTAINERS):
            fully_shard(child, mesh=mesh)
    return fsdp_modules(root)


def unsharded_parameters(module: nn.Module) -> list[str]:
    """Names of trainable parameters no FSDP unit manages (plain tensors, not DTensors): their
    gradients would not be synchronised."""
    return [n for n, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
