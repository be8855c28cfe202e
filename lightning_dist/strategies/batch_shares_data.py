"""The training data of a strategy with batch shares: ``SharesSampler`` (one rank's micro-batches
under its part's plan) and ``SharesLoader`` (the DataLoader on it, whose state Lightning checkpoints).
See ``lightning_dist.algorithms.batch_shares`` for the plan."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from lightning_dist.algorithms.batch_shares import micro_sizes, rank_positions
from lightning_dist.elastic.sampler import epoch_order

__all__ = ["SharesLoader", "SharesSampler"]


class SharesSampler(Sampler[list[int]]):
    """Batch sampler of one rank under its part's plan: its micro-batches, step by step, from
    ``start_step`` of ``epoch`` (see ``lightning_dist.algorithms.batch_shares``)."""

    def __init__(self, part: Any, dataset_len: int, epoch: int, given: object) -> None:
        self.part = part
        """The strategy's ``BatchShares`` (its plan, schedule and queue of micro-batch sizes)."""
        self.dataset_len = dataset_len
        self.epoch = epoch
        self.start_step = 0
        self.given = given
        """The loader's sampler: Lightning's DistributedSampler (its order is kept, so step s has the
        uniform run's samples), a RandomSampler (``epoch_order``) or another (the dataset's order)."""

    def order(self) -> torch.Tensor:
        """The epoch's order of the dataset's indices, the same on every rank."""
        given, n = self.given, self.dataset_len
        if isinstance(given, DistributedSampler):
            if not given.shuffle:
                return torch.arange(n)
            generator = torch.Generator()
            generator.manual_seed(given.seed + self.epoch)  # DistributedSampler's own permutation
            return torch.randperm(n, generator=generator)
        return epoch_order(n, self.part.seed, self.epoch, isinstance(given, RandomSampler))

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_len // self.part.total

    def __len__(self) -> int:
        """The whole epoch's micro-batches (Lightning counts a resumed epoch's from its progress)."""
        return self.steps_per_epoch * self.part.accumulate

    @property
    def sampler(self) -> SharesSampler:
        """Itself: Lightning calls ``set_epoch`` on ``batch_sampler.sampler``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.start_step = epoch, 0

    def __iter__(self) -> Iterator[list[int]]:
        part = self.part
        order = self.order()
        base = part.epoch_base = part.global_step() - self.start_step  # the epoch's step 0
        part.queued.clear()
        for j in range(self.start_step, self.steps_per_epoch):
            step = base + j
            start, stop = rank_positions(part.schedule.at(step), part.rank)
            position = j * part.total + start
            for m in micro_sizes(stop - start, part.accumulate):
                part.queued.append(m)
                part.yielded = max(part.yielded, step)
                yield order[position : position + m].tolist()
                position += m
        self.start_step = 0


class SharesLoader(DataLoader):
    """The training DataLoader on a ``SharesSampler``; its state (Lightning checkpoints it) is the
    epoch, the steps done in it and the shares schedule."""

    def state_dict(self) -> dict[str, Any]:
        sampler: SharesSampler = self.batch_sampler  # type: ignore[assignment]
        part = sampler.part
        done = part.global_step() - part.epoch_base
        return {"epoch": sampler.epoch, "step": done, "batch_shares": part.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sampler: SharesSampler = self.batch_sampler  # type: ignore[assignment]
        sampler.epoch, sampler.start_step = int(state["epoch"]), int(state["step"])
        sampler.part.load_state_dict(state["batch_shares"])
