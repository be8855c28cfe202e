"""``FaultTolerant``'s step: the quorum's gradient sum after the step's last micro-batch, the commit,
the optimizer step only once it is committed, and the schedulers put back after every batch that did
not end a committed step, so the learning rate follows committed steps only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_dist.algorithms.micro_batch_slots import group_slots, scaled_loss
from lightning_dist.compat import mark_last_batch
from lightning_dist.compression.packing import unflatten
from lightning_dist.strategies.fault_tolerant_commits import FaultTolerantCommits
from lightning_dist.strategies.fault_tolerant_state import OWNER, StepRecord, logger


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings without its parameters (what a scheduler may change)."""
    return {k: v for k, v in group.items() if k != "params"}


class FaultTolerantStep(FaultTolerantCommits):
    """A step's gradients, commit, optimizer step and scheduler undo (module docstring)."""

    reduce_op: str = "avg"
    """How the groups' gradients combine: ``"avg"`` (their sum: the mean over the step's samples) or
    ``"adasum"`` (``FaultTolerant``'s ``reduce_op``)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self.transport is None or self.plan is None:
            return output
        return scaled_loss(output, self.slots_per_step)  # one of the step's M micro-batches

    def _reduce_gradients(self) -> None:
        """Sum every parameter's gradient over every process of the quorum's groups (one flat sum:
        ``sum_over_groups``; or the group's sum, then the compressor's exchange of it, the same on
        each of the group's processes, so they keep the same compressor state). ``reduce_op="adasum"``:
        the group's sum, made the mean over the group's slots (``group_mean_scale``), then Adasum of
        the groups' means per parameter tensor (``adasum_over_groups``, or the compressor's exchange)."""
        assert self.transport is not None and self.lightning_module is not None
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        adasum = self.reduce_op == "adasum"
        if self.compression is None and not adasum:
            flat = self.transport.sum_over_groups(torch.cat([g.reshape(-1) for g in grads]))
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
            return
        if self.transport.group is not None:
            grads = unflatten(self.transport.sum_in_group(torch.cat([g.reshape(-1) for g in grads])), grads)
        if adasum:
            scale = self.group_mean_scale()
            if scale != 1:
                grads = [g * scale for g in grads]
        if self.compression is not None:
            grads = self.compression.reduce(self.transport.communicator, grads)
        else:
            self.transport.adasum_over_groups(grads)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.view_as(p)

    def group_mean_scale(self) -> float:
        """``M / n``: what turns this group's gradient (its ``n`` slots' gradients, each of a loss
        divided by the step's ``M``) into the mean over its own samples, the gradient each rank of
        ``DDP(reduce_op="adasum")`` brings to Adasum."""
        own = group_slots(self.slots_per_step, self._participants, self._group_size, self._rank)
        return self.slots_per_step / own if own else 1.0

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if self.transport is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        loss = closure()  # this batch's forward and backward
        params = self._trainable()
        self._gradients.add(params)
        if not self.last_in_step:
            self._hide_schedulers()
            return loss  # more of the step's batches to come
        self._gradients.restore(params)
        self._stepped = False
        result = self._step(optimizer, loss, model, **kwargs)
        if not self._stepped:
            self._hide_schedulers()
        assert self.plan is not None
        if self.data_step() // self.plan.steps_per_epoch > self._step_epoch:
            mark_last_batch(self._fit_trainer())  # the data epoch's last step: Lightning's epoch ends
        return result

    def _hide_schedulers(self) -> None:
        """Lightning steps the schedulers after every batch's optimizer step: until the batch's
        end (``show_schedulers``) it finds none, unless the batch ended a committed step."""
        if self.lr_scheduler_configs:
            self._hidden_schedulers, self.lr_scheduler_configs = self.lr_scheduler_configs, []

    def show_schedulers(self) -> None:
        """Give Lightning its schedulers back (``_hide_schedulers``)."""
        if self._hidden_schedulers:
            self.lr_scheduler_configs, self._hidden_schedulers = self._hidden_schedulers, []

    def _trainable(self) -> list[Tensor]:
        assert self.lightning_module is not None
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    def _step(self, optimizer: Any, loss: Any, model: Any, **kwargs: Any) -> Any:
        """After the step's backward pass: the gradients summed over the quorum, the commit, and the
        optimizer step once it is committed."""
        assert self.transport is not None
        self._reduce_gradients()
        step = self.transport.step
        committed = self.transport.commit()
        if self.compression is not None:
            self.compression.end_step(committed)
        if not committed:
            self.uncommitted_steps += 1
            optimizer.zero_grad(set_to_none=True)
            logger.debug("%s: step %d not committed; the quorum runs it again", OWNER, step)
            return loss
        self.committed.append(StepRecord(step, list(self._step_indices), self._participants))
        self._stepped = True
        return self.apply_step(optimizer, loss, model, **kwargs)

    def apply_step(self, optimizer: Any, loss: Any, model: Any, **kwargs: Any) -> Any:
        """The optimizer step itself, on the gradients there are (Lightning's: the precision plugin's)."""
        return super().optimizer_step(optimizer, lambda: loss, model, **kwargs)

    def keep_schedulers(self) -> None:
        """Take what a step that does not commit puts back: the schedulers' states and the
        optimizers' hyperparameters they set (``undo_schedulers``)."""
        self._schedulers = [c.scheduler.state_dict() for c in self._fit_trainer().lr_scheduler_configs]
        self._hyper = [[hyperparameters(g) for g in opt.param_groups] for opt in self.optimizers]

    def undo_schedulers(self) -> None:
        """After a batch that did not end a committed step (one before the step's last, or a step
        that was not committed), put back the schedulers and the hyperparameters they set as they
        were at the step's start, so the learning rate follows committed steps only (Lightning does
        not step them then: ``_hide_schedulers``)."""
        if self._stepped:
            return
        for config, state in zip(self._fit_trainer().lr_scheduler_configs, self._schedulers):
            config.scheduler.load_state_dict(state)
        for opt, groups in zip(self.optimizers, self._hyper):  # what the schedulers set (lr, momentum)
            for group, saved in zip(opt.param_groups, groups):
                group.update(saved)
