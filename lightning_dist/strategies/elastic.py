"""``Elastic``: data-parallel training under torchrun's elastic agent that resumes from atomic commits.

    torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=localhost:0 train.py          # train.py: L.Trainer(strategy=Elastic(commit_every=50))

The agent restarts every worker when one fails; this strategy adds the state the agent lacks. Every
``commit_every`` optimizer steps rank 0 writes a commit (``lightning_dist.elastic.CommitStore``:
temporary name, fsync, rename, checksum, the last ``keep`` kept) holding Lightning's checkpoint (model,
optimizers, schedulers, precision plugin, loop counters), every rank's compressor and RNG state, and
the data position. A (re)started run resumes from the newest valid commit without ``ckpt_path``.
The training data is read through an ``ElasticSampler``: every sample once per epoch, and step s's
global batch the same samples on every world size. Gradients reduce as ``Compressed`` does
(``compression=None`` is bitwise ``DDP()``; ``reduce_op="adasum"`` works at any world size).

The world size may change between restarts (``torchrun --nnodes=MIN:MAX``): the global batch is
kept (per-rank micro-batches and accumulation follow the new size), Lightning's loop counters in the
commit are rescaled to the new accumulation, the compressor states of the old ranks are merged
(``Compressor.merge_states``), and where the new size does not divide the global batch the learning
rate follows ``plan.lr_scale`` (``scale_lr=False`` turns that off).

``ElasticDiLoCo`` is the same machinery over ``DiLoCo`` (no gradient all-reduce; an outer Nesterov step
every ``inner_steps`` optimizer steps): its commits also hold DiLoCo's entry (every rank's weights,
inner optimizer and compressor state, the last-sync parameters, the outer momentum and the inner-step
counter), so a run resumed at the same world size continues bitwise; at another world size every rank
restarts from the last-sync parameters with rank 0's inner optimizer state (DiLoCo's fallback, with a
warning). ``ElasticMixin`` holds what both share (commits, sampler, resume).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.algorithms.lr_scaling import scale_learning_rates
from lightning_dist.collectives.model_check import check_same_model
from lightning_dist.compat import (
    _PATH,
    checkpoint_batch_progress,
    disable_distributed_sampler,
    fit_batches_started,
    restore_on_fit,
    set_checkpoint_loader_state,
)
from lightning_dist.compression import Compressor
from lightning_dist.elastic.commits import Commit, CommitStore, capture_rng_state, restore_rng_state
from lightning_dist.elastic.rendezvous import attempt_store
from lightning_dist.elastic.sampler import ElasticPlan, ElasticSampler
from lightning_dist.elastic.writer import BackgroundWriter
from lightning_dist.strategies.compressed import Compressed
from lightning_dist.strategies.diloco import DiLoCo
from lightning_dist.strategies.launch_needs import TORCHRUN
from lightning_dist.strategies.options import ElasticOptions, option_names, options_from
from lightning_dist.warn import warn_once

if TYPE_CHECKING:  # the mixin's super() calls reach a DDP with per-rank checkpoint state
    from lightning_dist.strategies.ddp import DDP
    from lightning_dist.strategies.rank_state import RankStateMixin

    class _MixinBase(RankStateMixin, DDP): ...

else:
    _MixinBase = object

logger = logging.getLogger(__name__)

ELASTIC_KEY = "lightning_dist.elastic"
"""The commit's entry for what Lightning's checkpoint lacks: data position, plan, per-rank RNG."""
ELASTIC_OPTIONS = tuple(option_names(ElasticOptions))
"""``ElasticMixin``'s options (every elastic strategy takes them)."""


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


class _CommitCallback(L.Callback):
    """Commits after every ``commit_every``-th optimizer step (at ``on_train_batch_end``, where
    ``global_step`` already counts the step whose weights are saved)."""

    def __init__(self, strategy: ElasticMixin) -> None:
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
        if self.strategy.writer is not None:
            # the commit written in the background during this step is on disk from here on, so a
            # restart redoes at most commit_every completed steps
            self.strategy.writer.wait()
        if step != self.last_step and step % self.strategy.commit_every == 0:
            self.strategy.commit(trainer)
        self.last_step = step


def _rescale_batch_progress(progress: dict[str, Any], ready: int) -> None:
    """Shift Lightning's micro-batch counters so the epoch's ``ready`` count is ``ready`` (another
    accumulation makes the same optimizer step another micro-batch number); offsets between the
    counters (``completed`` trails by one at ``on_train_batch_end``) are kept."""
    shift = ready - int(progress["current"]["ready"])
    for scope in ("current", "total"):
        for name in ("ready", "started", "processed", "completed"):
            progress[scope][name] = int(progress[scope][name]) + shift


class ElasticMixin(_MixinBase):
    """Commits, the elastic sampler and resume without ``ckpt_path``, for a ``DDP``-based strategy.

    A strategy lists it first (``class Elastic(ElasticMixin, Compressed)``) over a strategy with
    ``RankStateMixin`` and calls ``_init_elastic`` with its ``ElasticOptions`` in its ``__init__``; the
    per-rank state that strategy saves in its checkpoints (``rank_state``, ``rank_state_entries``)
    goes into every commit, gathered in the same collective as the ranks' RNG states. Options: see
    ``Elastic``.
    """

    launch_needs = TORCHRUN

    def _init_elastic(self, options: ElasticOptions) -> None:
        """Set the elastic state from the (checked) elastic options."""
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
        self._saved: dict[str, Any] = {}
        self._resume_plan: Optional[ElasticPlan] = None
        self._elastic_num_nodes = 1  # ``num_nodes`` (DDPStrategy's own field is private)
        self._committing = False
        """Whether ``save_checkpoint`` is writing a commit (``commit``) rather than a user's checkpoint."""
        self.lr_factor = 1.0
        """The factor the learning rates were multiplied by on resume (``scale_lr``)."""

    # -- (re)start ---------------------------------------------------------------------------------
    @property
    @override
    def num_nodes(self) -> int:
        return self._elastic_num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Under torchrun the agent's rendezvous decides the node count (``--nnodes=MIN:MAX``), not
        the Trainer's ``num_nodes``: Lightning checks devices x nodes against WORLD_SIZE."""
        if TorchElasticEnvironment.detect():
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            num_nodes = max(1, int(os.environ["WORLD_SIZE"]) // max(1, local))
        self._elastic_num_nodes = num_nodes

    @override
    def _process_group_kwargs(self) -> dict[str, Any]:
        if (
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
        ):
            warn_once(  # the same on every rank: shown once, by rank 0
                "Elastic: several torchrun agents share torch's rendezvous store; when a node leaves and "
                "joins again torch 2.x loses the master address and the workers' store keys of the round "
                "(the rendezvous times out). Start every torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
            )
        store = attempt_store(self._timeout or default_pg_timeout)
        return {} if store is None else {"store": store}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self._trainer()
        disable_distributed_sampler(trainer)  # the ElasticSampler shards the training data
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "elastic_commits")
        self.store = CommitStore(dirpath, keep=self.keep)
        self.writer = BackgroundWriter(self.store) if self.background_commits else None
        commit = self._newest_commit(self.store)
        step = None if commit is None else commit.step
        steps = self._transport().all_gather(torch.tensor([-1 if step is None else step]))
        if len({int(s) for s in steps}) != 1:
            raise RuntimeError(
                f"Elastic: ranks found different newest commits in {dirpath} "
                f"({[int(s) for s in steps]}); every rank must see the same directory"
            )
        if commit is None:
            logger.debug("Elastic: no commit in %s; a fresh run", dirpath)
            return
        checkpoint = commit.state
        saved = self._saved = dict(checkpoint[ELASTIC_KEY])
        sampler_state = saved["sampler"]
        plan = self._resume_plan = ElasticPlan(
            dataset_len=sampler_state["dataset_len"],
            global_batch=saved["global_batch"],
            world_size=self.world_size,
            micro_batch=saved["micro_batch"],
            base_world_size=saved["base_world_size"],
            on_indivisible=self.on_indivisible,
        )
        if saved["world_size"] != self.world_size:
            _rescale_batch_progress(
                checkpoint_batch_progress(checkpoint), sampler_state["step"] * plan.accumulate
            )
            if self.scale_lr:
                self.lr_factor = plan.lr_scale / saved["lr_scale"]
            logger.info(
                "Elastic: the commit of step %d was taken at world size %d; resuming at %d with %s",
                commit.step,
                saved["world_size"],
                self.world_size,
                plan,
            )
        set_checkpoint_loader_state(checkpoint, [sampler_state])
        restore_on_fit(trainer, checkpoint)  # Lightning restores it as a fit(ckpt_path=...) file
        self.resumed_from = commit.step
        logger.debug("Elastic: resuming from the commit of step %d (%s)", commit.step, commit.path)

    def _newest_commit(self, store: CommitStore) -> Optional[Commit]:
        """The commit this run resumes from (``None``: a fresh run): the newest valid one in ``store``."""
        return store.load_latest()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # a resumed run loads the commit before setup() compares the ranks' models: compare first,
        # so a rank with another model gets the same clear error as every other rank
        assert self.lightning_module is not None
        check_same_model(self.lightning_module, type(self).__name__, self._transport())
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        if not any(isinstance(c, _CommitCallback) and c.strategy is self for c in callbacks):
            callbacks.append(_CommitCallback(self))
        super().setup(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        rng = self._saved.get("rng")
        if rng is not None:  # on a larger world size the new ranks take the old ranks' states in turn
            restore_rng_state(rng[self.global_rank % len(rng)])
        if self.lr_factor != 1.0:
            scale_learning_rates(self.optimizers, self._trainer().lr_scheduler_configs, self.lr_factor)
            logger.info(
                "Elastic: learning rates scaled by %.6g (plan.lr_scale, linear scaling rule)", self.lr_factor
            )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer()
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError(
                "Elastic: the training DataLoader must be built with batch_size= (the per-rank micro-batch); "
                "Elastic supplies the sampler itself"
            )
        dataset_len = len(dataloader.dataset)  # type: ignore[arg-type]
        resumed = self._resume_plan
        if resumed is not None and resumed.dataset_len != dataset_len:
            raise ValueError(
                f"Elastic: the commit in {self.store.dirpath if self.store else '?'} was taken on a dataset "
                f"of {resumed.dataset_len} samples, the training DataLoader has {dataset_len}; resume with "
                "the same dataset or point dirpath= at a new directory"
            )
        if resumed is not None and resumed.micro_batch != dataloader.batch_size:
            warn_once(  # the same on every rank: shown once, by rank 0
                f"Elastic: the DataLoader's batch_size={dataloader.batch_size} differs from the committed "
                f"run's {resumed.micro_batch}; the committed plan is kept",
                stacklevel=2,
            )
        self.plan = resumed or ElasticPlan(
            dataset_len=dataset_len,
            global_batch=self.world_size * dataloader.batch_size * trainer.accumulate_grad_batches,
            world_size=self.world_size,
            micro_batch=dataloader.batch_size,
            on_indivisible=self.on_indivisible,
        )
        self.sampler = ElasticSampler(
            self.plan, self.global_rank, seed=self.seed, epoch=trainer.current_epoch
        )
        trainer.accumulate_grad_batches = self.plan.accumulate
        logger.debug("Elastic: %s", self.plan)
        return _ElasticLoader(
            dataloader.dataset,
            batch_sampler=self.sampler,
            num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory,
            worker_init_fn=dataloader.worker_init_fn,
        )

    def _trainer(self) -> L.Trainer:
        module = self.lightning_module
        assert module is not None, "Elastic: the strategy is not connected to a LightningModule yet"
        return module.trainer

    # -- commits -----------------------------------------------------------------------------------
    def commit(self, trainer: L.Trainer) -> None:
        """Write a commit of the state after the current optimizer step (called on every rank):
        Lightning dumps its checkpoint (``trainer.save_checkpoint``), and ``save_checkpoint`` below
        adds every rank's state and writes it to the commit store instead of a checkpoint file."""
        assert self.store is not None
        self._committing = True
        try:
            trainer.save_checkpoint(self.store.path(trainer.global_step), weights_only=False)
        finally:
            self._committing = False

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """A user's checkpoint (``ModelCheckpoint``) as the base strategy saves it; a commit: every
        rank's RNG and per-rank strategy state, gathered in one collective, into rank 0's commit."""
        if not self._committing:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        ranks = self.gather_rank_states(checkpoint)
        if ranks is None:
            return
        checkpoint = {**checkpoint, **self.rank_state_entries(ranks, checkpoint)}
        self._write_commit(checkpoint, [r["rng"] for r in ranks])

    @override
    def rank_state(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        own = super().rank_state(checkpoint)
        return {**own, "rng": capture_rng_state()} if self._committing else own

    def _write_commit(self, checkpoint: dict[str, Any], rng: list[Any]) -> None:
        """On rank 0: the commit of the state after the current optimizer step, written (in the
        background with ``background_commits``) with the data position and every rank's ``rng``."""
        self._store_commit(self._commit_payload(checkpoint, rng))

    def _store_commit(self, payload: dict[str, Any]) -> None:
        """On rank 0: write the commit ``payload`` of the current step (in the background with
        ``background_commits``)."""
        assert self.store is not None
        step = self._trainer().global_step
        if self.writer is not None:
            self.writer.submit(step, payload)
            logger.debug("Elastic: committing step %d in the background", step)
        else:
            path = self.store.save(step, payload)
            logger.debug("Elastic: committed step %d to %s", step, path)

    def _commit_payload(self, checkpoint: dict[str, Any], rng: list[Any]) -> dict[str, Any]:
        """``checkpoint`` (Lightning's, edited in place) made a commit: the data position, the plan
        and every rank's ``rng`` added, what is not needed to resume left out."""
        assert self.sampler is not None and self.plan is not None
        trainer = self._trainer()
        checkpoint.pop("hyper_parameters", None)  # not needed to resume; may hold arbitrary objects
        checkpoint.pop("hparams_name", None)
        # micro-batches done in this epoch, counting those before a resume: Lightning restores them
        steps_done = fit_batches_started(trainer) // self.plan.accumulate
        sampler_state = self.sampler.state_dict(step=steps_done)
        set_checkpoint_loader_state(checkpoint, [sampler_state])
        checkpoint[ELASTIC_KEY] = {
            "sampler": sampler_state,
            "global_batch": self.plan.global_batch,
            "base_world_size": self.plan.base_world_size or self.world_size,
            "micro_batch": self.plan.micro_batch,
            "lr_scale": self.plan.lr_scale,
            "world_size": self.world_size,
            "rng": rng,
        }
        return checkpoint

    @override
    def teardown(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()  # the last commit is on disk before the process may exit
        super().teardown()


class Elastic(ElasticMixin, Compressed):
    """Elastic data-parallel training with commits (see the module docstring).

    Args:
        commit_every: optimizer steps between commits; a restart redoes at most this many.
        keep: commits kept on disk (older ones are deleted after each commit).
        dirpath: where commits go; default ``<Trainer default_root_dir>/elastic_commits``. All ranks
            must see it (a shared filesystem across nodes).
        reduce_op: ``"avg"`` or ``"adasum"``.
        compression: None (no compression: bitwise ``DDP()``), a compressor name or a ``Compressor``.
        seed: seed of the per-epoch sample order.
        on_indivisible: what a world size that does not divide the global batch does; see
            ``lightning_dist.elastic.sampler``.
        scale_lr: on such a world size, multiply every learning rate (and every scheduler's base
            rates) by the plan's ``lr_scale`` (linear scaling rule); False leaves it to the user.
        background_commits: rank 0 snapshots the state at the commit step and writes it on a
            background thread during the next optimizer step, and waits for it at that step's end
            (``lightning_dist.elastic.BackgroundWriter``), so at most ``commit_every`` completed
            steps are ever redone; False writes before the next step starts.
        **options: ``Compressed``/``DDP`` options (``skip_nonfinite`` defaults to True here).
    """

    strategy_name = "ld_elastic"

    def __init__(
        self,
        commit_every: int = 50,
        keep: int = 3,
        dirpath: Optional[Union[str, os.PathLike[str]]] = None,
        reduce_op: str = "avg",
        compression: Union[None, str, Compressor] = None,
        seed: int = 0,
        on_indivisible: str = "keep_per_rank",
        scale_lr: bool = True,
        background_commits: bool = True,
        **options: Any,
    ) -> None:
        self._init_elastic(options_from(ElasticOptions, locals()))  # checks them
        options.setdefault("skip_nonfinite", True)
        options.setdefault("log_stats", False)
        super().__init__("none" if compression is None else compression, reduce_op=reduce_op, **options)

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        own = [*ELASTIC_OPTIONS[:3], "compression", *ELASTIC_OPTIONS[3:]]
        return [*own, *(o for o in Compressed._accepted_options() if o != "compressor")]


class ElasticDiLoCo(ElasticMixin, DiLoCo):
    """DiLoCo under torchrun's elastic agent, resuming from commits (see the module docstring).

        torchrun --nproc-per-node=2 --max-restarts=3 ... train.py   # strategy=ElasticDiLoCo(inner_steps=100)

    Args:
        commit_every, keep, dirpath, seed, on_indivisible, scale_lr, background_commits: as
            ``Elastic``'s. A commit may fall inside a DiLoCo period: it holds every rank's weights and
            inner optimizer state, so the resumed run continues exactly where the commit was taken.
        **options: ``DiLoCo``'s (``inner_steps``, ``outer_lr``, ``outer_momentum``, ``nesterov``,
            ``compression``, ``sync_buffers``, and the launch options). ``reduce_op`` and
            ``skip_nonfinite`` are refused: DiLoCo has no gradient all-reduce.
    """

    strategy_name = "ld_elastic_diloco"

    def __init__(
        self,
        commit_every: int = 50,
        keep: int = 3,
        dirpath: Optional[Union[str, os.PathLike[str]]] = None,
        seed: int = 0,
        on_indivisible: str = "keep_per_rank",
        scale_lr: bool = True,
        background_commits: bool = True,
        **options: Any,
    ) -> None:
        for name in ("skip_nonfinite", "reduce_op"):
            if name in options:
                raise ValueError(
                    f"ElasticDiLoCo: {name}={options[name]!r} is not supported (DiLoCo has no gradient "
                    f"all-reduce); accepted options: {', '.join(self._accepted_options())}"
                )
        self._init_elastic(options_from(ElasticOptions, locals()))  # checks them
        super().__init__(**options)

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        return [*ELASTIC_OPTIONS, *DiLoCo._accepted_options()]
