"""Per-rank state in checkpoints: what differs between ranks (compressor residuals, DiLoCo's local
weights, HorovodAdasum's optimizer moments, Elastic's RNG), gathered once and picked back per rank.

    STATES = RankStates("lightning_dist.x", "X", missing="the checkpoint has no X state")

    class X(RankStateMixin, DDP):
        def __init__(self):                                # this rank's part: picklable, CPU tensors
            self.training_state.register("x", self.x_state, per_rank=True, checkpoint=STATES)

        def load_optimizer_state_dict(self, checkpoint):   # each rank its own, or the fallback
            own = STATES.select(checkpoint.get(STATES.key), self.global_rank, self.world_size,
                                fallback="X starts afresh")

Saving gathers every rank's registered pieces (``rank_state``) to rank 0 in one collective (``gather_objects``), however
many strategy layers contribute (``ElasticDiLoCo``: RNG and DiLoCo's state). An entry is
``{"world_size": W, ...fields, "ranks": [rank r's state for r < W]}``; on load each rank takes its
own, and a checkpoint without the entry or from another world size gives ``None`` after exactly
one warning (``warn_once``) that says what the strategy does instead.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, Optional

import torch
from typing_extensions import override

from lightning_dist.collectives import Communicator
from lightning_dist.compat import _PATH
from lightning_dist.state import StateRegistry
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin

__all__ = ["RankStateMixin", "TrainingStateMixin", "gather_objects"]


def gather_objects(comm: Communicator, obj: Any, root: int = 0) -> Optional[list[Any]]:
    """Every rank's ``obj`` (picklable), in rank order, on ``root``; ``None`` on the other ranks.

    One ``all_to_all`` (after the communicator's exchange of byte counts): each rank sends its
    pickled ``obj`` to ``root`` and nothing to the others, so a rank other than ``root`` holds only
    its own state and ``root`` receives each other rank's bytes once. ``root``'s own entry is ``obj``
    itself. Called on every rank of ``comm``."""
    w, rank = comm.world_size, comm.rank
    if w == 1:
        return [obj]
    empty = torch.empty(0, dtype=torch.uint8)
    inputs = [empty] * w
    if rank != root:
        inputs[root] = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    to_transport = comm.backend.to_transport_device
    received = comm.all_to_all([to_transport(t) for t in inputs])
    if rank != root:
        return None
    out: list[Any] = []
    for r in range(w):
        if r == root:
            out.append(obj)
            continue
        data: Any = received[r].cpu().numpy()  # a buffer pickle reads without a copy
        out.append(pickle.loads(data))
        received[r] = empty  # each rank's bytes are released once unpickled
    return out


class TrainingStateMixin:
    """A strategy's ``training_state``: the ``StateRegistry`` its parts register their pieces in."""

    @property
    def training_state(self) -> StateRegistry:
        """The strategy's registry of training state (made on first use)."""
        registry = self.__dict__.get("_training_state")
        if registry is None:
            registry = self.__dict__["_training_state"] = StateRegistry()
        return registry


class RankStateMixin(TrainingStateMixin, CollectiveOpsMixin):
    """``save_checkpoint`` adds every rank's per-rank state to rank 0's checkpoint, gathered in one
    collective; put it before the strategy's Lightning base (``class DiLoCo(RankStateMixin, DDP)``).

    The state is what the strategy's parts registered in ``training_state`` (a ``StateRegistry``
    the strategy owns), gathered once however many parts contribute (``ElasticDiLoCo``: RNG and
    DiLoCo's state).
    """

    def rank_state(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's state for ``checkpoint`` (what ``trainer.save_checkpoint`` dumped), picklable
        with CPU tensors, under one key per piece; ``{}`` (on every rank alike) gathers nothing."""
        return self.training_state.own(checkpoint)

    def rank_state_entries(
        self, ranks: list[dict[str, Any]], checkpoint: Mapping[str, Any]
    ) -> dict[str, Any]:
        """On rank 0: the entries its checkpoint gets from every rank's ``rank_state`` (``ranks``)."""
        return self.training_state.entries(ranks, len(ranks))  # every rank of the gathering group

    def rank_state_comm(self) -> Communicator:
        """The communicator the per-rank states are gathered over: the strategy's own."""
        return self._transport()

    def gather_rank_states(self, checkpoint: Mapping[str, Any]) -> Optional[list[dict[str, Any]]]:
        """Every rank's ``rank_state(checkpoint)`` on rank 0 (``None`` on the others, or when there is
        none to gather). A collective: every rank calls it."""
        own = self.rank_state(checkpoint)
        if not own:
            return None
        return gather_objects(self.rank_state_comm(), own)

    def with_rank_states(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with the per-rank entries on rank 0, as it is on the other ranks (a collective)."""
        ranks = self.gather_rank_states(checkpoint)
        return checkpoint if ranks is None else {**checkpoint, **self.rank_state_entries(ranks, checkpoint)}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Gather the per-rank states into rank 0's checkpoint, then save as the base strategy does
        (call it on every rank, as ``trainer.save_checkpoint`` does). A weights-only checkpoint
        (no ``optimizer_states``) gets none."""
        if "optimizer_states" in checkpoint:
            checkpoint = self.with_rank_states(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)
