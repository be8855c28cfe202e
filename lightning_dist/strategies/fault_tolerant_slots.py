"""``FaultTolerant``'s exactly-once data: each step's quorum, the step's ``M`` micro-batch slots split
over the quorum's (group, process) pairs, and the micro-batches Lightning's loop sees (this process's
slots, read after the quorum: ``micro_batch_slots``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Optional

from typing_extensions import override

from lightning_dist.algorithms.micro_batch_slots import OwnBatches, owns_slot, slots_per_process
from lightning_dist.compat import set_global_step
from lightning_dist.elastic.sampler import ElasticPlan, ElasticSampler
from lightning_dist.strategies.elastic_data import is_training_loader
from lightning_dist.strategies.fault_tolerant_state import OWNER, logger
from lightning_dist.strategies.fault_tolerant_step import FaultTolerantStep


class FaultTolerantSlots(FaultTolerantStep):
    """The quorum of each step and the slots this process trains in it (module docstring)."""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not is_training_loader(
            dataloader, trainer, OWNER, "the micro-batch", "reads the samples of its slots itself"
        ):
            return dataloader
        assert trainer is not None and dataloader.batch_size is not None  # is_training_loader checked them
        micro = int(dataloader.batch_size)
        global_batch = self.options.global_batch or self.options.replica_groups * self._group_size * micro
        self.plan = ElasticPlan(
            dataset_len=len(dataloader.dataset),  # type: ignore[arg-type]
            global_batch=global_batch,
            world_size=1,
            micro_batch=micro,
            on_indivisible="error",
        )
        if trainer.accumulate_grad_batches not in (1, self.plan.accumulate):
            raise ValueError(
                f"{OWNER}: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); {OWNER} "
                "accumulates the global batch's micro-batches itself (global_batch=); accepted: 1"
            )
        processes = self.options.replica_groups * self._group_size
        if self.plan.accumulate < processes:
            raise ValueError(
                f"{OWNER}: global_batch={global_batch} is {self.plan.accumulate} micro-batch(es) of "
                f"batch_size={micro}, fewer than the {processes} processes of replica_groups="
                f"{self.options.replica_groups} x {self._group_size}: every process trains a micro-batch "
                f"of each step; accepted: global_batch >= {processes * micro}"
            )
        trainer.accumulate_grad_batches = 1  # Lightning steps at every batch; a step's sum is ours
        self._dataset = dataloader.dataset
        self._collate = dataloader.collate_fn
        per_step = slots_per_process(self.plan.accumulate, processes)
        return OwnBatches(self._own_batches, self.plan.steps_per_epoch * per_step, dataloader.dataset)

    def _own_batches(self) -> Iterator[Any]:
        """This process's micro-batches of the fit's current epoch: at each step's start the quorum
        (``_start_step``), then the samples of each slot it owns, collated (Lightning moves them to the
        device and calls the transfer hooks). Lightning pulls one batch at a time, so the next step's
        quorum comes after this one's last batch has stepped. Ends once the committed steps reach
        the next data epoch (or a commit caught up to reaches ``max_steps``)."""
        assert self.plan is not None
        trainer = self._fit_trainer()
        per_epoch = self.plan.steps_per_epoch
        epoch: Optional[int] = self._step_epoch if self._queue else None
        while True:
            if not self._queue:
                if epoch is not None and self.data_step() // per_epoch > epoch:
                    return
                slots = self._start_step()
                if slots is None:  # caught up from a commit: that step is not run
                    if trainer.should_stop:
                        return
                    continue
                self._queue = slots
                epoch = self._step_epoch if epoch is None else epoch
            slot = self._queue.pop(0)
            self.last_in_step = not self._queue
            indices = self.slot_indices(self.data_step(), slot)
            self._step_indices += indices
            set_global_step(trainer, self.data_step(), logger_step=True)
            yield self._collate([self._dataset[i] for i in indices])

    def _start_step(self) -> Optional[list[int]]:
        """The slots of the step about to start that this process trains, after its quorum
        (``_begin_step``); None when the step is not run (``_skipping``). What the step may have to
        put back is taken here: the schedulers and the optimizers' hyperparameters."""
        self._begin_step()
        if self._skipping:
            return None
        assert self.plan is not None
        self._step_indices = []
        self._stepped = False
        self._step_epoch = self.data_step() // self.plan.steps_per_epoch
        self.keep_schedulers()
        slots = [slot for slot in range(self.slots_per_step) if self.owns(slot)]
        if not slots:
            raise ValueError(
                f"{OWNER}: the quorum's {self._participants} group(s) x {self._group_size} process(es) are more "
                f"than the {self.slots_per_step} micro-batches of a step: this process would train none; "
                f"accepted: global_batch of at least (groups x processes) x batch_size"
            )
        return slots

    def _sampler(self, epoch: int) -> ElasticSampler:
        assert self.plan is not None
        if epoch not in self._samplers:
            self._samplers = {epoch: ElasticSampler(self.plan, 0, seed=self.options.seed, epoch=epoch)}
        return self._samplers[epoch]

    def slot_indices(self, step: int, slot: int) -> list[int]:
        """The dataset indices of ``slot`` of global step ``step`` (the same on every group)."""
        assert self.plan is not None
        epoch, in_epoch = divmod(step, self.plan.steps_per_epoch)
        return self._sampler(epoch).rank_batches(in_epoch, 0)[slot]

    @property
    def participants(self) -> int:
        """Groups in the current step's quorum."""
        return self._participants

    def owns(self, slot: int) -> bool:
        """Whether this process computes ``slot`` of the current step (``owns_slot`` over the quorum's
        participants x the group's processes)."""
        rank = None if self._rank is None else self._rank * self._group_size + self._group_rank
        return owns_slot(slot, self._participants * self._group_size, rank)

    def _begin_step(self) -> None:
        """The step's quorum (a recovering group loads its peer's state in it); a group behind the
        newest commit catches up to it instead (``_skipping``: the step is not run)."""
        assert self.transport is not None
        self._join()
        self._participants = max(1, self.transport.participants)
        self._rank = self.transport.participant_rank
        self._skipping = self._catch_up()
        if self.compression is not None:
            self.compression.begin_step(self.transport.step, self.transport.recovering_peers)
        if self._skipping:
            self._rank = None  # this step's quorum was formed at the old step: it is not run
        trainer = self._fit_trainer()
        set_global_step(trainer, self.data_step(), logger_step=True)
        if self._skipping and trainer.max_steps >= 0 and self.data_step() >= trainer.max_steps:
            trainer.should_stop = True

    def _join(self) -> None:
        """Join the step's quorum (a recovering group loads its peer's state here). The first step of
        a process that torchrun did not restart (a fresh run, or a whole job started again from its
        commits) asks again until ``start_groups`` groups are in it or ``quorum_timeout_s`` passed."""
        assert self.transport is not None
        deadline = time.monotonic() + self.options.timeouts.quorum_s
        start_groups = self.options.start_groups or self.options.replica_groups
        wait = not self._joined and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        self._joined = True
        self.transport.start_step()
        # the group's processes decide together (they form each quorum together)
        while wait and self.transport.group_agrees(
            self.transport.participants < start_groups and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            self.transport.start_step()
        if self.checks_group_sizes:
            self.transport.check_group_size()
        if wait and self.transport.participants < start_groups:
            logger.warning(
                "%s: %d of start_groups=%d groups joined within quorum_timeout_s=%s; starting with them",
                OWNER,
                self.transport.participants,
                start_groups,
                self.options.quorum_timeout_s,
            )
