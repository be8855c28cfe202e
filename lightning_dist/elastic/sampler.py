"""Elastic data positions: which samples every rank reads at every optimizer step, on any world size.

Terms: N ``dataset_len``; G ``global_batch`` (samples per optimizer step, all ranks together); W
``world_size``; a ``accumulate`` (micro-batches per rank per optimizer step); m ``micro`` (samples per
micro-batch, at most the user's ``micro_batch``).

Order
  An epoch reads the dataset in one order, a permutation of ``range(N)`` seeded by (seed, epoch)
  (``epoch_order``): the same on every rank, every restart and every world size. "Position p" is the
  p-th entry of that order.
Steps
  Optimizer steps take consecutive runs of positions. With the global batch G kept, step s takes
  positions [s*G, (s+1)*G): the same samples on every world size. A restart resumes at a committed
  (step, position); steps that ran after the commit and before the failure are redone, on the same
  positions. Across any number of restarts every position of the epoch is therefore read exactly once
  by the final trajectory (the last run of each step), save the tail below.
Layout
  The G positions of a step that starts at position p0 are W*a micro-batches of m. Micro-batch k
  (0 <= k < a) of rank r reads positions ``p0 + (k*W + r)*m`` up to ``p0 + (k*W + r + 1)*m``, so the
  W micro-batches of accumulation round k together cover one contiguous block of W*m positions.
Tail
  ``drop_last=True``: the last ``N mod G`` positions (fewer than one step) are not read in that epoch;
  they are positions, so the same samples on every world size, and the next epoch's order differs.
  ``drop_last=False``: the last step is filled up by wrapping round to the start of the epoch's order
  (positions taken modulo N), so the samples at the first ``G - N mod G`` positions are read twice.
Indivisible world sizes
  G is kept when W divides it: each rank takes G/W samples a step, as the smallest accumulate a whose
  micro-batch (G/W)/a fits ``micro_batch``. When W does not divide G, ``on_indivisible`` says what
  happens, with an ``ElasticBatchWarning`` naming the numbers and the learning-rate factor:
    "keep_per_rank" (default)  each rank keeps the accumulate and micro-batch of ``base_world_size``
                               (the configuration G was set for), so a step takes W*a*m samples;
    "round_global"             a step takes the largest multiple of W not above G (W if G < W);
    "error"                    a ValueError.
  Either fallback changes the samples per step, so the learning rate should follow the linear
  scaling rule: multiply it by ``plan.lr_scale`` (effective / configured global batch; 1.0 when W
  divides G). Positions stay consecutive, so "every sample once" still holds; "step s has the same
  samples" holds only among world sizes that divide G.

``ElasticSampler`` is a batch sampler (``DataLoader(dataset, batch_sampler=sampler)``): it yields
this rank's micro-batches as lists of indices. A batch sampler because the plan, not the DataLoader's
``batch_size``, sets the micro-batch size, which changes with the world size; the DataLoader needs no
rebuilding for it. Lightning must not shard it again (no ``DistributedSampler``): the strategy turns
Lightning's sampler injection off.

Pure Python and torch (for the permutation): nothing here imports torch.distributed or lightning.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch.utils.data import Sampler

from lightning_dist.checks import check_bool, check_choice, check_int
from lightning_dist.warn import warn_once

__all__ = [
    "ON_INDIVISIBLE",
    "ElasticBatchWarning",
    "ElasticPlan",
    "ElasticSampler",
    "epoch_order",
    "per_rank_split",
]

OWNER = "elastic"
ON_INDIVISIBLE = ("keep_per_rank", "round_global", "error")
STATE_KEYS = ("epoch", "step", "position", "seed", "global_batch", "dataset_len")


class ElasticBatchWarning(UserWarning):
    """The global batch, or the micro-batch, is not what was asked for on this world size."""


def per_rank_split(share: int, micro_batch: int) -> tuple[int, int]:
    """``(accumulate, micro)`` with ``accumulate * micro == share``, the smallest accumulate whose
    micro-batch is at most ``micro_batch`` (accumulate == share, micro == 1 at worst)."""
    check_int("share", share, 1, owner=OWNER)
    check_int("micro_batch", micro_batch, 1, owner=OWNER)
    least = -(-share // micro_batch)
    divisors: set[int] = set()
    for d in range(1, math.isqrt(share) + 1):
        if share % d == 0:
            divisors.update((d, share // d))
    accumulate = min(d for d in divisors if d >= least)
    return accumulate, share // accumulate


def _fail(message: str) -> Any:
    raise ValueError(f"{OWNER}: {message}")


@dataclass(frozen=True)
class ElasticPlan:
    """How one optimizer step's global batch is split over ``world_size`` ranks (see the module doc)."""

    dataset_len: int
    """Samples in the dataset (N)."""
    global_batch: int
    """Samples per optimizer step, all ranks together (G), as configured for ``base_world_size``."""
    world_size: int
    """Ranks alive now (W)."""
    micro_batch: int
    """Most samples one rank takes in one forward pass (the user's batch_size)."""
    drop_last: bool = True
    """Leave out an epoch's last, incomplete step (True) or fill it up from the epoch's start (False)."""
    base_world_size: Optional[int] = None
    """World size ``global_batch`` was configured for (it must divide it); None: ``world_size``."""
    on_indivisible: str = "keep_per_rank"
    """When ``world_size`` does not divide ``global_batch``: one of ``ON_INDIVISIBLE``."""

    accumulate: int = field(init=False)
    """Micro-batches per rank per optimizer step."""
    micro: int = field(init=False)
    """Samples per micro-batch (<= ``micro_batch``)."""
    effective_global_batch: int = field(init=False)
    """Samples per optimizer step on this world size: ``world_size * accumulate * micro``."""
    lr_scale: float = field(init=False)
    """``effective_global_batch / global_batch``: the linear-scaling factor for the learning rate."""
    steps_per_epoch: int = field(init=False)
    """Optimizer steps in an epoch read from its start."""

    def __post_init__(self) -> None:
        check_int("dataset_len", self.dataset_len, 1, owner=OWNER)
        check_int("global_batch", self.global_batch, 1, owner=OWNER)
        check_int("world_size", self.world_size, 1, owner=OWNER)
        check_int("micro_batch", self.micro_batch, 1, owner=OWNER)
        check_bool("drop_last", self.drop_last, owner=OWNER)
        if self.base_world_size is None:
            object.__setattr__(self, "base_world_size", self.world_size)
        base = self.base_world_size
        check_int("base_world_size", base, 1, owner=OWNER)
        assert isinstance(base, int)
        check_choice("on_indivisible", self.on_indivisible, ON_INDIVISIBLE, owner=OWNER)
        g, w = self.global_batch, self.world_size
        if g % base:
            _fail(
                f"global_batch={g} must be a multiple of base_world_size={base} (the world size it is "
                "configured for, world_size when not given)"
            )
        base_accumulate, base_micro = per_rank_split(g // base, self.micro_batch)
        if g % w == 0:
            effective = g
        elif self.on_indivisible == "error":
            _fail(
                f"global_batch={g} is not divisible by world_size={w} and on_indivisible='error'; "
                f"accepted on_indivisible: {', '.join(map(repr, ON_INDIVISIBLE))}"
            )
        elif self.on_indivisible == "keep_per_rank":
            effective = w * base_accumulate * base_micro
        else:
            effective = max(w, g // w * w)
        if g % w == 0 or self.on_indivisible == "round_global":
            accumulate, micro = per_rank_split(effective // w, self.micro_batch)
        else:
            accumulate, micro = base_accumulate, base_micro
        n = self.dataset_len
        if self.drop_last and effective > n:
            _fail(
                f"global_batch={g} (a step takes {effective} samples on world_size={w}) must be at most "
                f"dataset_len={n} with drop_last=True, or an epoch has no step"
            )
        object.__setattr__(self, "accumulate", accumulate)
        object.__setattr__(self, "micro", micro)
        object.__setattr__(self, "effective_global_batch", effective)
        object.__setattr__(self, "lr_scale", effective / g)
        object.__setattr__(self, "steps_per_epoch", n // effective if self.drop_last else -(-n // effective))
        if effective != g:
            if self.on_indivisible == "keep_per_rank":
                how = (
                    f"on_indivisible='keep_per_rank' keeps base_world_size={base}'s {accumulate} x {micro} "
                    "samples per rank (accumulate x micro)"
                )
            else:
                how = (
                    f"on_indivisible='round_global' rounds it to a multiple of world_size ({accumulate} x "
                    f"{micro} samples per rank, accumulate x micro)"
                )
            warn_once(  # every rank builds the same plan: shown once, by rank 0
                f"{OWNER}: global_batch={g} is not divisible by world_size={w}; {how}, so an optimizer "
                f"step takes {effective} samples and the learning rate should be scaled by "
                f"{effective}/{g} = {self.lr_scale:.6g} (plan.lr_scale, linear scaling rule); "
                "on_indivisible='error' refuses instead",
                ElasticBatchWarning,
                stacklevel=3,
            )
        share = effective // w
        if 2 * micro < min(self.micro_batch, share):
            warn_once(  # the same on every rank (each rank's share is equal)
                f"{OWNER}: a rank's {share} samples per step have no divisor near micro_batch="
                f"{self.micro_batch}, so they are read as {accumulate} micro-batches of {micro}; a "
                "global_batch with more divisors keeps the micro-batches large",
                ElasticBatchWarning,
                stacklevel=3,
            )

    @property
    def divisible(self) -> bool:
        """Whether this world size keeps the configured global batch."""
        return self.effective_global_batch == self.global_batch

    def for_world_size(self, world_size: int) -> ElasticPlan:
        """The same configuration on ``world_size`` ranks (``base_world_size`` stays)."""
        return replace(self, world_size=world_size)

    @classmethod
    def from_per_rank(
        cls,
        dataset_len: int,
        batch_size: int,
        accumulate_grad_batches: int,
        world_size: int,
        *,
        drop_last: bool = True,
        on_indivisible: str = "keep_per_rank",
    ) -> ElasticPlan:
        """The plan of a run configured per rank, Lightning's way (``batch_size`` and
        ``accumulate_grad_batches`` on ``world_size`` ranks): G = world_size * accumulate * batch_size."""
        check_int("batch_size", batch_size, 1, owner=OWNER)
        check_int("accumulate_grad_batches", accumulate_grad_batches, 1, owner=OWNER)
        check_int("world_size", world_size, 1, owner=OWNER)
        return cls(
            dataset_len=dataset_len,
            global_batch=world_size * accumulate_grad_batches * batch_size,
            world_size=world_size,
            micro_batch=batch_size,
            drop_last=drop_last,
            base_world_size=world_size,
            on_indivisible=on_indivisible,
        )


def _order_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch): (0, 1) and (1, 0) give different orders."""
    digest = hashlib.sha256(f"lightning_dist.elastic:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def epoch_order(dataset_len: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The epoch's order of the dataset's indices (int64): a permutation seeded by (seed, epoch),
    or ``arange`` without shuffle."""
    check_int("dataset_len", dataset_len, 1, owner=OWNER)
    check_int("seed", seed, 0, owner=OWNER)
    check_int("epoch", epoch, 0, owner=OWNER)
    if not shuffle:
        return torch.arange(dataset_len)
    generator = torch.Generator()
    generator.manual_seed(_order_seed(seed, epoch))
    return torch.randperm(dataset_len, generator=generator)


class ElasticSampler(Sampler[list[int]]):
    """Batch sampler of rank ``rank`` under ``plan``: yields its micro-batches (lists of dataset
    indices), ``plan.accumulate`` per optimizer step, from ``start_step`` to the end of ``epoch``.

    ``start_position`` is where ``start_step`` starts in the epoch's order; None means
    ``start_step * plan.effective_global_batch`` (right when no step of the epoch ran on another
    global batch). ``load_state_dict`` sets both from a commit. Steps read positions in the layout of
    the module doc.
    """

    def __init__(
        self,
        plan: ElasticPlan,
        rank: int,
        *,
        seed: int = 0,
        epoch: int = 0,
        start_step: int = 0,
        start_position: Optional[int] = None,
        shuffle: bool = True,
    ) -> None:
        if not isinstance(plan, ElasticPlan):
            _fail(f"plan must be an ElasticPlan, got {type(plan).__name__}")
        check_int("rank", rank, 0, plan.world_size - 1, owner=OWNER)
        check_int("seed", seed, 0, owner=OWNER)
        check_int("epoch", epoch, 0, owner=OWNER)
        check_int("start_step", start_step, 0, owner=OWNER)
        if start_position is None:
            start_position = start_step * plan.effective_global_batch
        check_int("start_position", start_position, 0, owner=OWNER)
        check_bool("shuffle", shuffle, owner=OWNER)
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.epoch = epoch
        self.start_step = start_step
        self.start_position = start_position
        self.shuffle = shuffle
        self._order_key: Optional[tuple[int, int, bool]] = None
        self._order = torch.empty(0, dtype=torch.long)

    # -- positions -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def num_steps(self) -> int:
        """Optimizer steps this sampler yields: from ``start_step`` to the end of the epoch."""
        left = self.plan.dataset_len - self.start_position
        if left <= 0:
            return 0
        g = self.plan.effective_global_batch
        return left // g if self.plan.drop_last else -(-left // g)

    @property
    def end_step(self) -> int:
        """The step number after the epoch's last step."""
        return self.start_step + self.num_steps

    @property
    def num_samples(self) -> int:
        """Indices this rank yields: ``len(self) * plan.micro``."""
        return len(self) * self.plan.micro

    def __len__(self) -> int:
        """Micro-batches this rank yields (what ``len(DataLoader)`` reports)."""
        return self.num_steps * self.plan.accumulate

    def position(self, step: int) -> int:
        """Where ``step`` (``start_step <= step <= end_step``) starts in the epoch's order."""
        check_int("step", step, self.start_step, self.end_step, owner=OWNER)
        return self.start_position + (step - self.start_step) * self.plan.effective_global_batch

    def order(self) -> torch.Tensor:
        """This epoch's order (see ``epoch_order``), computed once per (seed, epoch)."""
        key = (self.seed, self.epoch, self.shuffle)
        if self._order_key != key:
            self._order = epoch_order(self.plan.dataset_len, self.seed, self.epoch, self.shuffle)
            self._order_key = key
        return self._order

    def _read(self, order: torch.Tensor, start: int, stop: int) -> list[int]:
        n = self.plan.dataset_len
        if stop <= n:
            return order[start:stop].tolist()
        return order[torch.arange(start, stop) % n].tolist()  # drop_last=False: wrap round

    def _check_step(self, step: int) -> None:
        check_int("step", step, self.start_step, max(self.start_step, self.end_step - 1), owner=OWNER)
        if self.num_steps == 0:
            _fail(f"step={step}: no step is left in epoch {self.epoch} from start_step={self.start_step}")

    def step_indices(self, step: int) -> list[int]:
        """The dataset indices of ``step`` over all ranks, in position order."""
        self._check_step(step)
        p0 = self.position(step)
        return self._read(self.order(), p0, p0 + self.plan.effective_global_batch)

    def rank_batches(self, step: int, rank: Optional[int] = None) -> list[list[int]]:
        """The ``plan.accumulate`` micro-batches ``rank`` (default: this rank) reads at ``step``."""
        self._check_step(step)
        if rank is None:
            rank = self.rank
        check_int("rank", rank, 0, self.world_size - 1, owner=OWNER)
        return self._rank_batches(self.order(), self.position(step), rank)

    def _rank_batches(self, order: torch.Tensor, p0: int, rank: int) -> list[list[int]]:
        w, m = self.world_size, self.plan.micro
        starts = (p0 + (k * w + rank) * m for k in range(self.plan.accumulate))
        return [self._read(order, start, start + m) for start in starts]

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()  # fixed at the first next(): a later set_epoch does not change this pass
        g = self.plan.effective_global_batch
        for i in range(self.num_steps):
            yield from self._rank_batches(order, self.start_position + i * g, self.rank)

    # -- epochs and commits ----------------------------------------------------------------------

    @property
    def sampler(self) -> ElasticSampler:
        """Itself: Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``, not on the
        batch sampler, at every epoch start."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` from its start; the epoch already set keeps its start (a resumed one its
        committed step), as Lightning calls this again at the start of a resumed epoch."""
        check_int("epoch", epoch, 0, owner=OWNER)
        if epoch != self.epoch:
            self.epoch = epoch
            self.start_step = 0
            self.start_position = 0

    def state_dict(self, step: Optional[int] = None) -> dict[str, int]:
        """Plain ints (a weights_only checkpoint loads them) that resume the epoch at ``step``
        (default ``start_step``; at most ``end_step``): the steps done in the epoch when committing."""
        if step is None:
            step = self.start_step
        return {
            "epoch": self.epoch,
            "step": step,
            "position": self.position(step),
            "seed": self.seed,
            "global_batch": self.plan.global_batch,
            "dataset_len": self.plan.dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict``'s output, whatever the world size it was saved on."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            _fail(f"state lacks {', '.join(missing)}; a sampler state holds {', '.join(STATE_KEYS)}")
        for key in STATE_KEYS:
            check_int(
                f"state[{key!r}]", state[key], 1 if key in ("global_batch", "dataset_len") else 0, owner=OWNER
            )
        if state["dataset_len"] != self.plan.dataset_len:
            _fail(
                f"state['dataset_len']={state['dataset_len']} differs from plan.dataset_len="
                f"{self.plan.dataset_len}: positions of another dataset do not resume this one"
            )
        if state["global_batch"] != self.plan.global_batch:
            warn_once(  # every rank loads the same state: shown once, by rank 0
                f"{OWNER}: the state was saved with global_batch={state['global_batch']}, the plan has "
                f"{self.plan.global_batch}: the epoch resumes at position {state['position']}, but its "
                "steps from here on take other samples than the saved run's would",
                ElasticBatchWarning,
                stacklevel=2,
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.start_step = state["step"]
        self.start_position = state["position"]
