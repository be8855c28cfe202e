"""The option groups of resilience: what the elastic strategies (``Elastic``, ``ElasticDiLoCo``,
``HorovodElastic``) and the torchft ones (``FaultTolerant``, ``FaultTolerantDiLoCo``) add to their
base's options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_dist.checks import check_bool, check_choice, check_int, check_number, check_positive
from lightning_dist.collectives.fault_tolerant_addresses import check_host, check_lighthouse, check_replica_id
from lightning_dist.collectives.fault_tolerant_timeouts import FaultTolerantTimeouts, derive_timeouts
from lightning_dist.elastic.sampler import ON_INDIVISIBLE

__all__ = ["ElasticOptions", "FaultTolerantDiLoCoOptions", "FaultTolerantOptions"]


@dataclass
class ElasticOptions:
    """What every elastic strategy (``Elastic``, ``ElasticDiLoCo``) adds to its base's options."""

    commit_every: int = 50
    """Optimizer steps between commits; a restart redoes at most this many."""
    keep: int = 3
    """Commits kept on disk."""
    dirpath: Optional[Union[str, os.PathLike[str]]] = None
    """Where commits go (default: ``<default_root_dir>/elastic_commits``); every rank must see it."""
    seed: int = 0
    """Seed of the per-epoch sample order."""
    on_indivisible: str = "keep_per_rank"
    """What a world size that does not divide the global batch does (``elastic.sampler``)."""
    scale_lr: bool = True
    background_commits: bool = True

    def __post_init__(self) -> None:
        check_int("commit_every", self.commit_every, 1)
        check_int("keep", self.keep, 1)
        check_int("seed", self.seed, 0)
        check_choice("on_indivisible", self.on_indivisible, ON_INDIVISIBLE)
        check_bool("scale_lr", self.scale_lr)
        check_bool("background_commits", self.background_commits)
        if self.dirpath is not None and not isinstance(self.dirpath, (str, os.PathLike)):
            raise ValueError(f"dirpath={self.dirpath!r} is not supported; accepted: None, a str or a path")


@dataclass
class FaultTolerantOptions:
    """``FaultTolerant``'s options (each documented on the class)."""

    replica_groups: int = 2
    global_batch: Optional[int] = None
    min_replica_size: int = 1
    lighthouse: Optional[str] = None
    replica_id: Optional[Union[str, int]] = None
    """An int becomes its digits (``check_replica_id``)."""
    host: Optional[str] = None
    peer_timeout_s: float = 60.0
    """The one timeout: how long a peer may be silent; the others follow (``fault_tolerant_timeouts``)."""
    timeout_s: Optional[float] = None  # type: ignore[assignment]
    """None: from ``peer_timeout_s`` (resolved here, a float afterwards)."""
    quorum_timeout_s: Optional[float] = None  # type: ignore[assignment]
    """None: from ``peer_timeout_s`` (resolved here, a float afterwards)."""
    quorum_retries: int = 3
    seed: int = 0
    commit_every: int = 50
    dirpath: Optional[Union[str, os.PathLike[str]]] = None
    keep: int = 3
    start_groups: Optional[int] = None
    """None: ``replica_groups`` (resolved here)."""
    verbose: Optional[bool] = None
    """None: ``$LD_FT_VERBOSE`` (``fault_tolerant_logs``)."""
    timeouts: FaultTolerantTimeouts = field(init=False, repr=False)
    """Every timeout, derived once (``derive_timeouts``)."""

    def __post_init__(self) -> None:
        owner = "FaultTolerant"
        if self.lighthouse is not None:
            check_lighthouse(self.lighthouse, owner=owner)
        self.replica_id = check_replica_id(self.replica_id, owner=owner)
        check_host(self.host, owner=owner)
        if self.verbose is not None:
            check_bool("verbose", self.verbose, owner=owner)
        check_int("replica_groups", self.replica_groups, 1, owner=owner)
        if self.global_batch is not None:
            check_int("global_batch", self.global_batch, 1, owner=owner)
        check_int("min_replica_size", self.min_replica_size, 1, self.replica_groups, owner=owner)
        check_positive("peer_timeout_s", self.peer_timeout_s, owner=owner)
        if self.timeout_s is not None:
            check_positive("timeout_s", self.timeout_s, owner=owner)
        if self.quorum_timeout_s is not None:
            check_positive("quorum_timeout_s", self.quorum_timeout_s, owner=owner)
        self.timeouts = derive_timeouts(self.peer_timeout_s, self.timeout_s, self.quorum_timeout_s)
        self.timeout_s, self.quorum_timeout_s = self.timeouts.collective_s, self.timeouts.quorum_s
        check_int("seed", self.seed, 0, owner=owner)
        check_int("quorum_retries", self.quorum_retries, 0, owner=owner)
        check_int("commit_every", self.commit_every, 0, owner=owner)
        check_int("keep", self.keep, 1, owner=owner)
        if self.dirpath is not None and not isinstance(self.dirpath, (str, os.PathLike)):
            raise ValueError(f"{owner}: dirpath={self.dirpath!r}; accepted: None, a str or a path")
        if self.start_groups is None:
            self.start_groups = self.replica_groups
        check_int("start_groups", self.start_groups, 1, self.replica_groups, owner=owner)


@dataclass
class FaultTolerantDiLoCoOptions:
    """What ``FaultTolerantDiLoCo`` adds to ``FaultTolerant``'s and ``DiLoCo``'s options."""

    rejoin_timeout_s: float = 60.0
    """How long the groups at a sync that did not commit (a group of the period failed) wait for the
    period's groups to be back in the quorum; past it they run the period again among themselves."""

    def __post_init__(self) -> None:
        check_number("rejoin_timeout_s", self.rejoin_timeout_s, 0, owner="FaultTolerantDiLoCo")
