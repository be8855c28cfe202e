"""Fit under Horovod's elastic engine: ``horovodrun --min-np/--max-np --host-discovery-script``.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh \\
        --network-interface eth0 python train.py

    # train.py
    def make_trainer():
        return L.Trainer(strategy=HorovodElastic(commit_every=1), max_steps=1000)
    fit_horovod_elastic(make_trainer, MyModule())

Each attempt builds a new Trainer and fits; Horovod's ``hvd.elastic.run`` starts another attempt
after ``hvd.shutdown(); hvd.init()`` when a worker died or the hosts changed, and the new fit resumes
from the last commit that ``HorovodElastic`` handed to Horovod's elastic state (in every process's
memory; a joining worker receives rank 0's). A fit never restarts the processes that survive.

Launch notes (Horovod 0.28.1): without ``--network-interface`` (``-nics``) the elastic driver waits
until at least two hosts are discovered, to probe their common interfaces, so a one-host job hangs
there until ``--elastic-timeout`` (600 s); on one host give ``--network-interface lo``. The
discovery script must be executable and print one ``hostname:slots`` line per host; a host whose
address is not this machine's is reached over ssh.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import lightning as L

from lightning_dist.collectives.horovod_elastic import CommitState, elastic_run, make_commit_state
from lightning_dist.strategies.horovod_elastic import HorovodElastic

logger = logging.getLogger(__name__)

__all__ = ["fit_horovod_elastic"]


def fit_horovod_elastic(
    make_trainer: Callable[[], L.Trainer], model: L.LightningModule, **fit_kwargs: Any
) -> L.Trainer:
    """``make_trainer().fit(model, **fit_kwargs)`` under Horovod's elastic engine, again on the
    new set of workers after every reset, resuming from the last commit; returns the Trainer of the
    attempt that finished. ``make_trainer`` must build a Trainer whose strategy is ``HorovodElastic``.

    Before the first commit an attempt starts from ``model``'s initial weights (kept here), so a
    failure in the first steps does not carry an uncommitted update into the next attempt.
    """
    initial = copy.deepcopy(model.state_dict())
    state = make_commit_state()

    def attempt(state: CommitState) -> L.Trainer:
        trainer = make_trainer()
        strategy = trainer.strategy
        if not isinstance(strategy, HorovodElastic):
            raise ValueError(
                f"fit_horovod_elastic: make_trainer() built a Trainer with strategy {type(strategy).__name__}; "
                "accepted: HorovodElastic (Trainer(strategy=HorovodElastic(...)))"
            )
        strategy.elastic_state = state
        if state.committed is None:
            model.load_state_dict(initial)
        logger.info("fit_horovod_elastic: attempt after %d resets", state.resets)
        trainer.fit(model, **fit_kwargs)
        return trainer

    return elastic_run(attempt, state)
