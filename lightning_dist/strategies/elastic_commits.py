"""``ElasticCommits``: Elastic's resilience part (commits with torchrun restarts), held by a strategy
as ``resilience``: the commit store and writer, the resume from the newest commit (data position,
Lightning's counters and the learning rates at another world size, each rank's RNG), the commit
payload. ``ElasticMixin`` is its glue to a Lightning strategy."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional, Protocol

import lightning as L
import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.algorithms.lr_scaling import scale_learning_rates
from lightning_dist.collectives import Communicator
from lightning_dist.compat import (
    checkpoint_batch_progress,
    fit_batches_started,
    restore_on_fit,
    set_checkpoint_loader_state,
)
from lightning_dist.elastic.commits import Commit, CommitStore, restore_rng_state
from lightning_dist.elastic.rendezvous import attempt_store
from lightning_dist.elastic.sampler import ElasticPlan, ElasticSampler
from lightning_dist.elastic.writer import BackgroundWriter
from lightning_dist.strategies.options_resilience import ElasticOptions
from lightning_dist.warn import warn_once

logger = logging.getLogger(__name__)

ELASTIC_KEY = "lightning_dist.elastic"
"""The commit's entry for what Lightning's checkpoint lacks: data position, plan, per-rank RNG."""


class _ElasticLoader(DataLoader):
    """The training DataLoader on an ``ElasticSampler``. ``len`` is the whole epoch's micro-batch
    count (Lightning adds the resumed count itself), and its state is the sampler's position."""

    def __len__(self) -> int:
        sampler: ElasticSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler.end_step * sampler.plan.accumulate

    def state_dict(self) -> dict[str, int]:
        sampler: ElasticSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sampler: ElasticSampler = self.batch_sampler  # type: ignore[assignment]
        sampler.load_state_dict(state)


def _rescale_batch_progress(progress: dict[str, Any], ready: int) -> None:
    """Shift Lightning's micro-batch counters so the epoch's ``ready`` count is ``ready`` (another
    accumulation makes the same optimizer step another micro-batch number); offsets between the
    counters (``completed`` trails by one at ``on_train_batch_end``) are kept."""
    shift = ready - int(progress["current"]["ready"])
    for scope in ("current", "total"):
        for name in ("ready", "started", "processed", "completed"):
            progress[scope][name] = int(progress[scope][name]) + shift


def torchrun_num_nodes(num_nodes: int) -> int:
    """The node count torchrun's rendezvous decided (WORLD_SIZE / LOCAL_WORLD_SIZE), else ``num_nodes``."""
    if TorchElasticEnvironment.detect():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        num_nodes = max(1, int(os.environ["WORLD_SIZE"]) // max(1, local))
    return num_nodes


def process_group_kwargs(timeout: timedelta) -> dict[str, Any]:
    """The process group's store of this restart attempt (``attempt_store``), with a warning where
    several torchrun agents share torch's rendezvous store."""
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    ):
        warn_once(  # the same on every rank: shown once, by rank 0
            "Elastic: several torchrun agents share torch's rendezvous store; when a node leaves and "
            "joins again torch 2.x loses the master address and the workers' store keys of the round "
            "(the rendezvous times out). Start every torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
        )
    store = attempt_store(timeout)
    return {} if store is None else {"store": store}


class ElasticCommits:
    """Commits, restore, data position and learning-rate scaling (module docstring); options: see
    ``Elastic``."""

    def __init__(self, options: ElasticOptions) -> None:
        self.commit_every = options.commit_every
        self.keep = options.keep
        self.dirpath = options.dirpath
        self.seed = options.seed
        self.on_indivisible = options.on_indivisible
        self.scale_lr = options.scale_lr
        self.background_commits = options.background_commits
        self.writer: Optional[BackgroundWriter] = None
        self.store: Optional[CommitStore] = None
        self.plan: Optional[ElasticPlan] = None
        self.sampler: Optional[ElasticSampler] = None
        self.resumed_from: Optional[int] = None
        """The step of the commit this run resumed from (None: a fresh run)."""
        self.saved: dict[str, Any] = {}
        """The resumed commit's ``ELASTIC_KEY`` entry ({}: a fresh run)."""
        self.resume_plan: Optional[ElasticPlan] = None
        self.lr_factor = 1.0
        """The factor the learning rates were multiplied by on resume (``scale_lr``)."""

    def resume(
        self,
        trainer: L.Trainer,
        comm: Communicator,
        world_size: int,
        newest: Callable[[CommitStore], Optional[Commit]],
    ) -> None:
        """Open the commit store (``dirpath``, default ``<default_root_dir>/elastic_commits``) and
        resume from its ``newest`` commit, the same on every rank (None: a fresh run): the plan at
        ``world_size``, Lightning's counters and the learning rates rescaled to it, the checkpoint
        handed to Lightning as a ``fit(ckpt_path=...)`` file."""
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "elastic_commits")
        self.store = CommitStore(dirpath, keep=self.keep)
        self.writer = BackgroundWriter(self.store) if self.background_commits else None
        commit = newest(self.store)
        step = None if commit is None else commit.step
        steps = comm.all_gather(torch.tensor([-1 if step is None else step]))
        if len({int(s) for s in steps}) != 1:
            raise RuntimeError(
                f"Elastic: ranks found different newest commits in {dirpath} "
                f"({[int(s) for s in steps]}); every rank must see the same directory"
            )
        if commit is None:
            logger.debug("Elastic: no commit in %s; a fresh run", dirpath)
            return
        checkpoint = commit.state
        saved = self.saved = dict(checkpoint[ELASTIC_KEY])
        sampler_state = saved["sampler"]
        plan = self.resume_plan = ElasticPlan(
            dataset_len=sampler_state["dataset_len"],
            global_batch=saved["global_batch"],
            world_size=world_size,
            micro_batch=saved["micro_batch"],
            base_world_size=saved["base_world_size"],
            on_indivisible=self.on_indivisible,
        )
        if saved["world_size"] != world_size:
            _rescale_batch_progress(
                checkpoint_batch_progress(checkpoint), sampler_state["step"] * plan.accumulate
            )
            if self.scale_lr:
                self.lr_factor = plan.lr_scale / saved["lr_scale"]
            logger.info(
                "Elastic: the commit of step %d was taken at world size %d; resuming at %d with %s",
                commit.step,
                saved["world_size"],
                world_size,
                plan,
            )
        set_checkpoint_loader_state(checkpoint, [sampler_state])
        restore_on_fit(trainer, checkpoint)  # Lightning restores it as a fit(ckpt_path=...) file
        self.resumed_from = commit.step
        logger.debug("Elastic: resuming from the commit of step %d (%s)", commit.step, commit.path)

    def on_train_start(self, rank: int, optimizers: Sequence[Any], scheduler_configs: Sequence[Any]) -> None:
        """This rank's RNG state from the commit and the learning rates scaled by ``lr_factor``."""
        rng = self.saved.get("rng")
        if rng is not None:  # on a larger world size the new ranks take the old ranks' states in turn
            restore_rng_state(rng[rank % len(rng)])
        if self.lr_factor != 1.0:
            scale_learning_rates(optimizers, scheduler_configs, self.lr_factor)
            logger.info(
                "Elastic: learning rates scaled by %.6g (plan.lr_scale, linear scaling rule)", self.lr_factor
            )

    def payload(
        self, checkpoint: dict[str, Any], trainer: L.Trainer, world_size: int, rng: list[Any]
    ) -> dict[str, Any]:
        """``checkpoint`` (Lightning's, edited in place) made a commit: the data position, the plan
        and every rank's ``rng`` added, what is not needed to resume left out."""
        assert self.sampler is not None and self.plan is not None
        checkpoint.pop("hyper_parameters", None)  # not needed to resume; may hold arbitrary objects
        checkpoint.pop("hparams_name", None)
        # micro-batches done in this epoch, counting those before a resume: Lightning restores them
        steps_done = fit_batches_started(trainer) // self.plan.accumulate
        sampler_state = self.sampler.state_dict(step=steps_done)
        set_checkpoint_loader_state(checkpoint, [sampler_state])
        checkpoint[ELASTIC_KEY] = {
            "sampler": sampler_state,
            "global_batch": self.plan.global_batch,
            "base_world_size": self.plan.base_world_size or world_size,
            "micro_batch": self.plan.micro_batch,
            "lr_scale": self.plan.lr_scale,
            "world_size": world_size,
            "rng": rng,
        }
        return checkpoint

    def store_commit(self, step: int, payload: dict[str, Any]) -> None:
        """On rank 0: write the commit ``payload`` of ``step`` (in the background with
        ``background_commits``)."""
        assert self.store is not None
        if self.writer is not None:
            self.writer.submit(step, payload)
            logger.debug("Elastic: committing step %d in the background", step)
        else:
            path = self.store.save(step, payload)
            logger.debug("Elastic: committed step %d to %s", step, path)

    def close(self) -> None:
        """The last commit on disk before the process may exit."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


class Committing(Protocol):
    """A strategy holding ``ElasticCommits`` (``ElasticMixin``): ``commit`` writes one on every rank."""

    resilience: ElasticCommits

    def commit(self, trainer: L.Trainer) -> None: ...


class CommitCallback(L.Callback):
    """Commits after every ``commit_every``-th optimizer step (at ``on_train_batch_end``, where
    ``global_step`` already counts the step whose weights are saved)."""

    def __init__(self, strategy: Committing) -> None:
        self.strategy = strategy
        self.last_step = -1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.strategy.resilience.writer is not None:
            # the commit written in the background during this step is on disk from here on, so a
            # restart redoes at most commit_every completed steps
            self.strategy.resilience.writer.wait()
        if step != self.last_step and step % self.strategy.resilience.commit_every == 0:
            self.strategy.commit(trainer)
        self.last_step = step
