"""Building blocks for elastic (torchrun) training, which restarts and resizes jobs: atomic verified
commits of the training state (``commits``) and a data position that survives restarts and
world-size changes (``sampler``), a writer that commits in the background (``writer``), and the
process-group store of each restart attempt (``rendezvous``). The ``Elastic`` strategy
(``lightning_dist.strategies.elastic``) joins them."""

from lightning_dist.elastic.commits import (
    Commit,
    CommitStore,
    CommitWarning,
    capture_rng_state,
    restore_rng_state,
)
from lightning_dist.elastic.sampler import ElasticBatchWarning, ElasticPlan, ElasticSampler, epoch_order
from lightning_dist.elastic.writer import BackgroundWriter, snapshot

__all__ = [
    "BackgroundWriter",
    "Commit",
    "CommitStore",
    "CommitWarning",
    "ElasticBatchWarning",
    "ElasticPlan",
    "ElasticSampler",
    "capture_rng_state",
    "epoch_order",
    "restore_rng_state",
    "snapshot",
]
