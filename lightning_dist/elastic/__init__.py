"""Building blocks for elastic (torchrun) training, which restarts and resizes jobs: atomic verified
commits of the training state (``commits``) and a data position that survives restarts and
world-size changes (``sampler``). The ``Elastic`` strategy that joins them is not built yet."""

from lightning_dist.elastic.commits import (
    Commit,
    CommitStore,
    CommitWarning,
    capture_rng_state,
    restore_rng_state,
)
from lightning_dist.elastic.sampler import ElasticBatchWarning, ElasticPlan, ElasticSampler, epoch_order

__all__ = [
    "Commit",
    "CommitStore",
    "CommitWarning",
    "ElasticBatchWarning",
    "ElasticPlan",
    "ElasticSampler",
    "capture_rng_state",
    "epoch_order",
    "restore_rng_state",
]
