"""Refuse, on every rank, a model whose parameters or buffers differ between the ranks.

Data-parallel strategies broadcast rank 0's weights and then reduce gradients tensor by tensor: a
rank whose model has another shape, another tensor, or another dtype makes those collectives fail
on some ranks only, or wait forever. ``check_same_model`` compares a digest of every rank's
description first (one small all-gather) and, only when they differ, exchanges the descriptions to
say what differs, with the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import hashlib
import struct

import torch
from torch import nn

from lightning_dist.collectives import Communicator

Entry = tuple[str, str, tuple[int, ...], str, bool]
"""(kind, name, shape, dtype, requires_grad) of one parameter or buffer."""

HINT = (
    "Build the same model on every rank: check for rank-dependent code in __init__/configure_model "
    "(layer sizes, optional layers, dtypes or frozen layers chosen by rank or by per-rank files or data)."
)


def describe_model(module: nn.Module) -> list[Entry]:
    """Every parameter and buffer of ``module``, in registration order."""
    params: list[Entry] = [
        ("parameter", name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
        for name, p in module.named_parameters()
    ]
    buffers: list[Entry] = [
        ("buffer", name, tuple(b.shape), str(b.dtype).removeprefix("torch."), False)
        for name, b in module.named_buffers()
    ]
    return params + buffers


def _digest_words(entries: list[Entry]) -> list[int]:
    """The sha256 of ``entries`` as four signed 64-bit words (what an int64 all-gather carries)."""
    digest = hashlib.sha256(repr(entries).encode()).digest()
    return list(struct.unpack("<4q", digest))


def _show(entry: Entry) -> str:
    _, _, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad or entry[0] == "buffer" else ", requires_grad=False"
    return f"shape {shape} {dtype}{frozen}"


def first_difference(reference: list[Entry], other: list[Entry], rank: int) -> str:
    """The first entry where rank ``rank``'s description ``other`` differs from rank 0's ``reference``."""
    theirs = {(e[0], e[1]): e for e in other}
    ours = {(e[0], e[1]) for e in reference}
    for entry in reference:
        kind, name = entry[0], entry[1]
        match = theirs.get((kind, name))
        if match is None:
            return f"{kind} {name!r} ({_show(entry)} on rank 0) is missing on rank {rank}"
        if match != entry:
            return f"{kind} {name!r} has {_show(entry)} on rank 0 but {_show(match)} on rank {rank}"
    for entry in other:
        if (entry[0], entry[1]) not in ours:
            return f"{entry[0]} {entry[1]!r} ({_show(entry)} on rank {rank}) is missing on rank 0"
    return f"rank 0 and rank {rank} hold the same parameters and buffers, registered in a different order"


def check_same_model(module: nn.Module, owner: str, comm: Communicator) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks' ``module`` has the same
    parameters and buffers (names, shapes, dtypes, ``requires_grad``), in the same order.

    Called on every rank at once, before the first collective on the model's tensors. ``owner``
    (the strategy's name) starts the message; ``comm`` is the strategy's communicator.
    """
    if comm.world_size <= 1:
        return
    entries = describe_model(module)
    words = torch.tensor(_digest_words(entries), dtype=torch.int64)
    gathered = comm.all_gather(comm.backend.to_transport_device(words), same_shape=True)
    digests = [tuple(int(x) for x in g.cpu().tolist()) for g in gathered]
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differing:
        return
    first = differing[0]
    # every rank passes an object of the same type: Horovod names a broadcast after its type
    reference = comm.broadcast_object(entries, 0)
    other = comm.broadcast_object(entries, first)
    ranks = (
        f"rank {first} differs" if len(differing) == 1 else f"ranks {', '.join(map(str, differing))} differ"
    )
    raise ValueError(
        f"{owner}: the model differs between ranks ({ranks} from rank 0): "
        f"{first_difference(reference, other, first)} ({len(reference)} parameters and buffers on rank 0, "
        f"{len(other)} on rank {first}). {HINT}"
    )
