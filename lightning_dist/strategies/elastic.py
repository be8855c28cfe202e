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

``ElasticMixin`` joins a strategy (ElasticDiLoCo, HorovodElastic too) to its part ``ElasticCommits``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

import lightning as L
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from lightning_dist.collectives.model_check import check_same_model
from lightning_dist.compat import _PATH, disable_distributed_sampler
from lightning_dist.compression import Compressor
from lightning_dist.elastic.commits import Commit, CommitStore, capture_rng_state
from lightning_dist.elastic.sampler import ElasticPlan, ElasticSampler
from lightning_dist.elastic.writer import BackgroundWriter
from lightning_dist.strategies.compressed import Compressed
from lightning_dist.strategies.elastic_commits import (
    CommitCallback,
    ElasticCommits,
    _ElasticLoader,
    process_group_kwargs,
    torchrun_num_nodes,
)
from lightning_dist.strategies.elastic_data import is_training_loader
from lightning_dist.strategies.launch_needs import TORCHRUN
from lightning_dist.strategies.options import option_names, options_from
from lightning_dist.strategies.options_resilience import ElasticOptions
from lightning_dist.strategies.part_field import PartField
from lightning_dist.warn import warn_once

if TYPE_CHECKING:  # the mixin's super() calls reach a DDP with per-rank checkpoint state
    from lightning_dist.strategies.ddp import DDP
    from lightning_dist.strategies.rank_state import RankStateMixin

    class _MixinBase(RankStateMixin, DDP): ...

else:
    _MixinBase = object

logger = logging.getLogger(__name__)

ELASTIC_OPTIONS = tuple(option_names(ElasticOptions))
"""``ElasticMixin``'s options (every elastic strategy takes them)."""


class ElasticMixin(_MixinBase):
    """Commits, the elastic sampler and resume without ``ckpt_path``, for a ``DDP``-based strategy: the
    glue to its resilience part (``resilience``), whose state reads as its own (``strategy.plan``).

    A strategy lists it first (``class Elastic(ElasticMixin, Compressed)``) over a strategy with
    ``RankStateMixin`` and calls ``_init_elastic`` with its ``ElasticOptions`` in its ``__init__``; the
    per-rank state that strategy saves in its checkpoints (``rank_state``, ``rank_state_entries``)
    goes into every commit, gathered in the same collective as the ranks' RNG states. Options: see
    ``Elastic``.
    """

    launch_needs = TORCHRUN
    resilience: ElasticCommits
    commit_every: PartField[int] = PartField("resilience")
    keep: PartField[int] = PartField("resilience")
    dirpath: PartField[Optional[Union[str, os.PathLike[str]]]] = PartField("resilience")
    seed: PartField[int] = PartField("resilience")
    on_indivisible: PartField[str] = PartField("resilience")
    scale_lr: PartField[bool] = PartField("resilience")
    background_commits: PartField[bool] = PartField("resilience")
    writer: PartField[Optional[BackgroundWriter]] = PartField("resilience")
    store: PartField[Optional[CommitStore]] = PartField("resilience")
    plan: PartField[Optional[ElasticPlan]] = PartField("resilience")
    sampler: PartField[Optional[ElasticSampler]] = PartField("resilience")
    resumed_from: PartField[Optional[int]] = PartField("resilience")
    lr_factor: PartField[float] = PartField("resilience")
    _resume_plan: PartField[Optional[ElasticPlan]] = PartField("resilience", "resume_plan")

    def _init_elastic(self, options: ElasticOptions) -> None:
        """The resilience part from the (checked) elastic options."""
        self.resilience = ElasticCommits(options)
        self._elastic_num_nodes = 1  # ``num_nodes`` (DDPStrategy's own field is private)
        self._committing = False
        """Whether ``save_checkpoint`` is writing a commit (``commit``) rather than a user's checkpoint."""
        self.training_state.register("rng", self._rng_piece, per_rank=True, active=self._is_committing)

    # -- (re)start ---------------------------------------------------------------------------------
    @property
    @override
    def num_nodes(self) -> int:
        return self._elastic_num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Under torchrun the agent's rendezvous decides the node count (``--nnodes=MIN:MAX``), not
        the Trainer's ``num_nodes``: Lightning checks devices x nodes against WORLD_SIZE."""
        self._elastic_num_nodes = torchrun_num_nodes(num_nodes)

    @override
    def _process_group_kwargs(self) -> dict[str, Any]:
        return process_group_kwargs(self._timeout or default_pg_timeout)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self._trainer()
        disable_distributed_sampler(trainer)  # the ElasticSampler shards the training data
        self.resilience.resume(trainer, self._transport(), self.world_size, self._newest_commit)

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
        if not any(isinstance(c, CommitCallback) and c.strategy is self for c in callbacks):
            callbacks.append(CommitCallback(self))
        super().setup(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.resilience.on_train_start(
            self.global_rank, self.optimizers, self._trainer().lr_scheduler_configs
        )

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer()
        why = "supplies the sampler itself"
        if not is_training_loader(dataloader, trainer, "Elastic", "the per-rank micro-batch", why):
            return dataloader
        assert dataloader.batch_size is not None  # is_training_loader checked it
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

    def _rng_piece(self, checkpoint: Mapping[str, Any]) -> Any:
        return capture_rng_state()

    def _is_committing(self) -> bool:
        return self._committing

    def _write_commit(self, checkpoint: dict[str, Any], rng: list[Any]) -> None:
        """On rank 0: the commit of ``checkpoint`` with the data position and every rank's ``rng``."""
        self._store_commit(self._commit_payload(checkpoint, rng))

    def _store_commit(self, payload: dict[str, Any]) -> None:
        """On rank 0: write the commit ``payload`` of the current step (``ElasticCommits.store_commit``)."""
        self.resilience.store_commit(self._trainer().global_step, payload)

    def _commit_payload(self, checkpoint: dict[str, Any], rng: list[Any]) -> dict[str, Any]:
        """``checkpoint`` (Lightning's, edited in place) made a commit (``ElasticCommits.payload``)."""
        return self.resilience.payload(checkpoint, self._trainer(), self.world_size, rng)

    @override
    def teardown(self) -> None:
        self.resilience.close()  # the last commit is on disk before the process may exit
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
