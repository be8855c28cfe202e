"""Per-rank batch shares (``shares=[3, 1]`` or ``shares="balanced"``): one part every layout uses.

``BatchShares`` is the part (the plan of ``lightning_dist.algorithms.batch_shares``: which samples
each rank trains at each step, the loss weight, the balancer); ``BatchSharesMixin`` is its glue to a
Lightning strategy (``DDP``, ``Compressed``, ``Sharded``, ``DiLoCo``): it reads the training data by the plan
(in place of Lightning's DistributedSampler), weights each micro-batch's loss by
``W * a * m / B`` before backward (so every reduction, compressor and Adasum sees weighted gradients
and the update is the uniform run's on the same B samples), times ``training_step`` per sample and,
with a balancer, agrees on new shares every ``window`` steps from the ranks' gathered times.
``DiLoCo`` weighs its pseudo-gradients instead of the loss (``period_weight``).

The shares schedule is one replicated piece of training state (``"batch_shares"``) and travels in
Lightning's checkpoint with the data position (the training DataLoader's state), so a resume reads
the samples and shares the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_dist.algorithms.batch_shares import (
    Balance,
    ShareSchedule,
    balanced_shares,
    hand_shares,
    loss_scale,
    parse_shares,
)
from lightning_dist.strategies.batch_shares_data import SharesLoader, SharesSampler
from lightning_dist.strategies.elastic_data import is_training_loader
from lightning_dist.strategies.rank_state import TrainingStateMixin
from lightning_dist.warn import warn_once

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    from lightning_dist.strategies.collective_ops import CollectiveOpsMixin

    class _MixinBase(CollectiveOpsMixin, ParallelStrategy): ...

else:
    _MixinBase = object

__all__ = ["BatchShares", "BatchSharesMixin", "refuse_shares"]

DILOCO_SHARES = (
    "its pseudo-gradients are averaged over replica groups of shards, where a weight by samples "
    "trained is not built (DiLoCo over replicated ranks takes shares)"
)
RESILIENCE_SHARES = (
    "reads the data by its own plan (ElasticSampler), which re-splits the global batch on every "
    "world size; shares over that plan are not built"
)
FAULT_TOLERANT_SHARES = (
    "FaultTolerant splits a step into micro-batch slots shared by the quorum's groups; shares over "
    "its slots are not built"
)

logger = logging.getLogger(__name__)


def refuse_shares(owner: str, options: Mapping[str, Any], why: str) -> None:
    """``ValueError`` when ``options`` set ``shares`` on a strategy that does not take them."""
    if options.get("shares") is not None:
        raise ValueError(f"{owner} does not take shares={options['shares']!r}: {why}; accepted: shares=None")


class BatchShares:
    """The shares part of one strategy: the plan (set at the training loader), the loss weight of
    the micro-batch being trained, the balancer's window and the shares schedule."""

    def __init__(
        self, weights: Optional[tuple[float, ...]], balance: Optional[Balance], seed: int = 0
    ) -> None:
        self.weights = weights
        self.balance = balance
        self.seed = seed
        self.clock: Callable[[], float] = time.perf_counter
        """What ``training_step`` is timed with (tests give a clock of their own)."""
        self.world = self.rank = self.total = self.accumulate = 0
        self.lag = 0
        """Steps a new plan waits: the DataLoader's workers read that far ahead."""
        self.schedule = ShareSchedule([])
        self.queued: deque[int] = deque()
        """Sizes of the micro-batches read and not yet trained, in order."""
        self.yielded = -1
        self.epoch_base = 0
        self.global_step: Callable[[], int] = lambda: 0
        self.scale = 1.0
        self.seconds = 0.0
        self.samples = 0
        self.decided = -1
        self.changes: list[tuple[int, list[int]]] = []
        """Every change of plan this run: (first step, shares)."""
        self.weigh_loss = True
        """Weight each micro-batch's loss (False: DiLoCo weighs its pseudo-gradients instead)."""
        self.last_step = 0

    def plan(self, world: int, rank: int, total: int, accumulate: int, lag: int) -> None:
        """The first plan: hand shares, or uniform ones for the balancer to move."""
        self.world, self.rank, self.total, self.accumulate, self.lag = world, rank, total, accumulate, lag
        weights = self.weights or (1.0,) * world
        if len(weights) != world:
            raise ValueError(
                f"shares={list(weights)} has {len(weights)} entries for {world} data-parallel ranks; "
                "accepted: one positive number per rank"
            )
        if total < world * accumulate:
            raise ValueError(
                f"shares: a global batch of {total} samples cannot give each of {world} ranks "
                f"{accumulate} micro-batches of at least one sample"
            )
        if not self._fits(self.schedule):  # a first fit, or a later one on other ranks or batch
            self.schedule = ShareSchedule([(0, hand_shares(weights, total, accumulate))])

    # -- a micro-batch ------------------------------------------------------------------------------
    def begin_micro_batch(self) -> None:
        m = self.queued.popleft() if self.queued else self.total // (self.world * self.accumulate)
        self.scale = loss_scale(self.world, self.accumulate, m, self.total) if self.weigh_loss else 1.0
        self._micro = m
        self.last_step = self.global_step()

    def period_weight(self, steps: int) -> float:
        """The factor on this rank's pseudo-gradient over the last ``steps`` steps (DiLoCo):
        ``W * (its samples in them) / (steps * B)``, so the mean over ranks weighs each by samples."""
        last = self.last_step
        own = sum(self.schedule.at(t)[self.rank] for t in range(last - steps + 1, last + 1))
        return self.world * own / (steps * self.total)

    def timed(self, seconds: float) -> None:
        self.seconds += seconds
        self.samples += self._micro

    # -- a step boundary ----------------------------------------------------------------------------
    def step_done(self, done: int, gather: Callable[[Tensor], list[Tensor]]) -> None:
        """After the optimizer step that makes ``done`` steps: every ``window`` steps, gather the
        ranks' seconds per sample and plan new shares (on every rank the same)."""
        if self.balance is None or done == self.decided or done % self.balance.window:
            return
        self.decided = done
        own = torch.tensor([self.seconds, float(self.samples)], dtype=torch.float64)
        rows = [r.to(torch.float64).cpu() for r in gather(own)]
        self.seconds, self.samples = 0.0, 0
        if any(float(r[1]) == 0 for r in rows):
            return  # a window without samples on some rank (a resume inside it): no plan
        per_sample = [float(r[0]) / float(r[1]) for r in rows]
        current = self.schedule.changes[-1][1]
        new = balanced_shares(per_sample, current, self.balance, self.accumulate)
        if new == current:
            return
        first = done + math.ceil(self.lag / self.accumulate)
        if self.yielded >= first:
            raise RuntimeError(
                f"shares: step {first} was read before its plan was made; the DataLoader reads further "
                "ahead than its num_workers * prefetch_factor"
            )
        self.schedule.prune(done)
        self.schedule.add(first, new)
        self.changes.append((first, new))
        rank_zero_info(
            f"shares: from step {first} ranks train {new} of {self.total} samples per step "
            f"(seconds per sample over the last {self.balance.window} steps: "
            f"{', '.join(f'{t:.3g}' for t in per_sample)})"
        )

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(), "decided": self.decided, "total": self.total}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        schedule = ShareSchedule.from_state(state["schedule"])
        if not self._fits(schedule):
            warn_once(
                f"shares: the checkpoint's shares {schedule.changes[-1][1]} do not split this run's global "
                f"batch of {self.total} over {self.world} ranks; the run starts from its own shares"
            )
            return
        self.schedule, self.decided = schedule, int(state["decided"])

    def _fits(self, schedule: ShareSchedule) -> bool:
        """Whether ``schedule`` splits this run's global batch over its ranks."""
        changes = schedule.changes
        return bool(changes) and all(len(s) == self.world and sum(s) == self.total for _, s in changes)

    def _piece(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        return self.state_dict()


class BatchSharesMixin(TrainingStateMixin, _MixinBase):
    """A strategy's glue to its ``BatchShares`` part (``strategy.batch_shares``; None without shares):
    list it before the Lightning base and call ``_init_shares`` in ``__init__``."""

    batch_shares: Optional[BatchShares] = None

    def _init_shares(self, shares: Any) -> None:
        weights, balance = parse_shares(shares)
        if weights is None and balance is None:
            return
        resilience = getattr(self, "resilience", None)  # Elastic's part, set before DDP.__init__
        if resilience is not None:
            why = f"its resilience part ({type(resilience).__name__}) {RESILIENCE_SHARES}"
            refuse_shares(type(self).__name__, {"shares": shares}, why)
        self.batch_shares = BatchShares(weights, balance)
        part = self.batch_shares
        self.training_state.register("batch_shares", part._piece, per_rank=False, load=part.load_state_dict)

    def _shares_trainer(self) -> L.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @override
    def process_dataloader(self, dataloader: object) -> object:
        part = self.batch_shares
        trainer = self._shares_trainer() if part is not None else None
        why = "reads each rank's share of the global batch itself"
        if part is None or not is_training_loader(
            dataloader, trainer, "shares", "the uniform per-rank batch", why
        ):
            return super().process_dataloader(dataloader)  # type: ignore[safe-super]
        assert trainer is not None and dataloader.batch_size is not None
        kwargs = self.distributed_sampler_kwargs
        world, rank, accumulate = (
            int(kwargs["num_replicas"]),
            int(kwargs["rank"]),
            trainer.accumulate_grad_batches,
        )
        workers = dataloader.num_workers
        lag = workers * (dataloader.prefetch_factor or 2) if workers > 0 else 0
        part.plan(world, rank, world * dataloader.batch_size * accumulate, accumulate, lag)
        part.global_step = lambda: trainer.global_step
        part.epoch_base = trainer.global_step
        given = dataloader.sampler  # the user's, or the DistributedSampler Lightning put over it
        sampler = SharesSampler(part, len(dataloader.dataset), trainer.current_epoch, given)  # type: ignore[arg-type]
        logger.debug("shares: rank %d of %d, plan %s", rank, world, part.schedule.changes)
        return SharesLoader(
            dataloader.dataset,
            batch_sampler=sampler,
            num_workers=workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            worker_init_fn=dataloader.worker_init_fn,
            prefetch_factor=dataloader.prefetch_factor if workers > 0 else None,
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        part = self.batch_shares
        if part is None:
            return super().training_step(*args, **kwargs)  # type: ignore[safe-super]
        part.begin_micro_batch()
        start = part.clock()
        out = super().training_step(*args, **kwargs)  # type: ignore[safe-super]
        part.timed(part.clock() - start)
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        part = self.batch_shares
        if part is not None and part.scale != 1.0:
            closure_loss = closure_loss * part.scale  # weighted before any reduction sees the gradients
        return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[safe-super]

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[safe-super]
        part = self.batch_shares
        if part is not None and part.world:
            # the loop counts this step once the strategy's optimizer_step returned
            part.step_done(self._shares_trainer().global_step + 1, self._transport().all_gather)
        return result
