"""``HorovodElastic``: ``Horovod`` with the pack's elastic state, for Horovod's elastic engine.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        --network-interface eth0 python train.py
    # train.py: lightning_dist.launch.horovod_elastic.fit_horovod_elastic(make_trainer, model)
    #           with make_trainer() -> L.Trainer(strategy=HorovodElastic(commit_every=1))

Gradients reduce as ``Horovod``'s do; the data and the commits are ``Elastic``'s (``ElasticMixin``):
the training data is read through an ``ElasticSampler``, so step s's global batch is the same
samples on every world size, and every ``commit_every`` optimizer steps a commit (Lightning's
checkpoint, the data position, every rank's RNG) is taken. Under
``lightning_dist.launch.horovod_elastic`` each commit is also handed to Horovod's elastic state
(``elastic_state``) on every rank, in memory, and Horovod then checks for host changes: when the
discovery script's host list changed, or a worker died, the fit stops, Horovod resets its ranks,
and a new fit resumes from that in-memory commit (a worker that joins receives it from rank 0).
Rank 0 also writes each commit to the commit store (``dirpath``), the floor when the whole job dies.

``lr_scale="auto"`` is 1.0 here, not Horovod's world size: the global batch is fixed by the plan
(fewer workers accumulate more micro-batches), so the averaged gradient is over the same samples
at every world size.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import lightning as L
from typing_extensions import override

from lightning_dist.collectives.horovod_elastic import CommitState
from lightning_dist.compat import _PATH
from lightning_dist.elastic.commits import Commit, CommitStore
from lightning_dist.strategies.elastic import ELASTIC_OPTIONS, ElasticMixin
from lightning_dist.strategies.horovod import Horovod
from lightning_dist.strategies.horovod_base import HOROVOD_OPTIONS
from lightning_dist.strategies.launch_needs import HOROVODRUN_ELASTIC
from lightning_dist.strategies.options import reject_unknown_options
from lightning_dist.strategies.options_resilience import ElasticOptions
from lightning_dist.strategies.rank_state import RankStateMixin, gather_objects

logger = logging.getLogger(__name__)


class HorovodElastic(ElasticMixin, RankStateMixin, Horovod):
    """``Horovod`` with elastic commits and data positions (see the module docstring).

    Args:
        commit_every: optimizer steps between commits; 1 by default: a commit stays in memory
            (Horovod's elastic state), and Horovod notices host changes only at a commit.
        **options: ``Elastic``'s ``keep``, ``dirpath``, ``seed``, ``on_indivisible``, ``scale_lr``,
            ``background_commits``; ``Horovod``'s ``op``, ``compression``, ``lr_scale`` and launch
            options (``lr_scale="auto"`` is 1.0 here: the global batch does not change with the
            world size).
    """

    strategy_name = "ld_horovod_elastic"
    launch_needs = HOROVODRUN_ELASTIC

    def __init__(self, commit_every: int = 1, **options: Any) -> None:
        unknown = {k: v for k, v in options.items() if k not in (*ELASTIC_OPTIONS, *HOROVOD_OPTIONS)}
        reject_unknown_options(type(self).__name__, unknown, (*ELASTIC_OPTIONS, *HOROVOD_OPTIONS))
        elastic = {k: options.pop(k) for k in ELASTIC_OPTIONS if k in options}
        self._init_elastic(ElasticOptions(**{**elastic, "commit_every": commit_every}))  # checks them
        # Horovod's, named: ElasticMixin's type-checking base is DDP (its bases define no __init__)
        Horovod.__init__(self, **options)
        self.elastic_state: Optional[CommitState] = None
        """Horovod's elastic state this fit commits to (set by ``fit_horovod_elastic``); None: the
        commits go to ``dirpath`` only, as ``Elastic``'s do."""

    @override
    def _auto_lr_scale(self) -> float:
        return 1.0

    @override
    def _newest_commit(self, store: CommitStore) -> Optional[Commit]:
        """The elastic state's commit when it has one (a reset inside this job), a copy: the resume
        edits what it loads; else the newest in ``store`` (a new job)."""
        held = None if self.elastic_state is None else self.elastic_state.committed
        if held is None:
            return super()._newest_commit(store)
        step = int(held["global_step"])
        logger.info("HorovodElastic: resuming from the in-memory commit of step %d", step)
        return Commit(step=step, state=copy.deepcopy(held), path=store.path(step))

    @override
    def commit(self, trainer: L.Trainer) -> None:
        super().commit(trainer)
        if self.elastic_state is not None:
            self.elastic_state.commit()  # raises HostsUpdatedInterrupt when the hosts changed

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """A commit with an elastic state: every rank holds the whole commit (any survivor may be
        rank 0 after a reset, and rank 0's is the one a joining worker gets); rank 0 also writes it."""
        if not self._committing or self.elastic_state is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        comm = self._transport()
        ranks = comm.broadcast_object(gather_objects(comm, self.rank_state(checkpoint)), 0)
        checkpoint = {**checkpoint, **self.rank_state_entries(ranks, checkpoint)}
        payload = copy.deepcopy(self._commit_payload(checkpoint, [r["rng"] for r in ranks]))
        self.elastic_state.stage(payload)
        if self.global_rank == 0:
            self._store_commit(payload)
