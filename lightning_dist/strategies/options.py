"""The strategies' options, declared once, as the compressors' configs are: each group is a dataclass
whose fields are the options (default and docstring each) and whose ``__post_init__`` checks them,
raising a ``ValueError`` that names the argument and what is accepted.

A strategy's constructor keeps its explicit keyword arguments (what IDEs and LightningCLI read),
builds the groups it takes from them (``options_from(DDPOptions, locals())``), and accepts exactly
their fields: ``option_names`` lists them and ``reject_unknown_options`` refuses anything else,
naming every accepted one. Reduction ops have
one vocabulary, ``lightning_dist.collectives.ops`` (``"avg"``/``"mean"``/``"average"``,
``"sum"``/``"add"``, torch's ``ReduceOp``, ``"adasum"``). No Lightning import here: the package root
reads the vocabularies below to register the strategy names before Lightning is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Optional, TypeVar, Union

from torch.distributed.constants import default_pg_timeout

from lightning_dist.checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive,
    reject_unknown_options,
)
from lightning_dist.collectives.fault_tolerant_addresses import check_host, check_lighthouse, check_replica_id
from lightning_dist.collectives.ops import normalize_op, op_name
from lightning_dist.elastic.sampler import ON_INDIVISIBLE

__all__ = [
    "COMPRESSED_REDUCE_OPS",
    "DILOCO_COMPRESSIONS",
    "GRADIENT_REDUCE_OPS",
    "HOROVOD_COMPRESSIONS",
    "HOROVOD_OPS",
    "PROCESS_GROUP_BACKENDS",
    "SHARDED_COMPRESSIONS",
    "SHARDED_REDUCE_OPS",
    "START_METHODS",
    "DDPOptions",
    "DiLoCoOptions",
    "ElasticOptions",
    "HorovodOptions",
    "LaunchOptions",
    "ShardedOptions",
    "check_bool",
    "check_choice",
    "check_positive",
    "normalize_op",
    "op_name",
    "option_names",
    "options_from",
    "reject_unknown_options",
]

PROCESS_GROUP_BACKENDS = (None, "gloo", "nccl", "mpi")
START_METHODS = ("auto", "popen", "spawn", "fork", "forkserver")
GRADIENT_REDUCE_OPS = ("avg", "sum", "adasum")
"""How ``DDP`` combines gradients."""
COMPRESSED_REDUCE_OPS = ("avg", "adasum")
"""How ``Compressed`` (and ``Elastic``) combine gradients."""
HOROVOD_OPS = ("avg", "sum")
"""How ``Horovod`` combines gradients (Adasum of the updates is ``HorovodAdasum``)."""
HOROVOD_COMPRESSIONS = (None, "none", "fp16", "bf16")
DILOCO_COMPRESSIONS = ("none", "fp16", "bf16", "int8")
"""Compressors whose exchange returns the average over ranks (what the pseudo-gradient needs)."""
SHARDED_COMPRESSIONS = (None, "bf16", "fp16", "int8")
"""How ``Sharded`` reduce-scatters gradients inside a shard group (None: fp32, uncompressed)."""
SHARDED_REDUCE_OPS = ("avg", "adasum")
"""How ``Sharded`` combines the replica groups' shard gradients (HSDP)."""

T = TypeVar("T")


def options_from(group: type[T], arguments: Mapping[str, Any]) -> T:
    """``group`` built (and so checked) from the same-named entries of ``arguments``, a constructor's
    ``locals()``: the options are named once, as the dataclass's fields."""
    return group(**{f.name: arguments[f.name] for f in fields(group)})  # type: ignore[arg-type]


def option_names(*groups: type, without: Iterable[str] = ()) -> list[str]:
    """The fields of the option dataclasses ``groups``, in order, each once, less ``without``."""
    names = dict.fromkeys(f.name for group in groups for f in fields(group))
    return [name for name in names if name not in set(without)]


@dataclass
class LaunchOptions:
    """How Lightning starts and connects the ranks: ``DDPStrategy``'s own arguments."""

    accelerator: Optional[Any] = None
    """Set by the Trainer when None, as are the next four."""
    parallel_devices: Optional[list[Any]] = None
    cluster_environment: Optional[Any] = None
    checkpoint_io: Optional[Any] = None
    precision_plugin: Optional[Any] = None
    process_group_backend: Optional[str] = None
    """``None`` (NCCL on CUDA, Gloo on CPU), ``"gloo"``, ``"nccl"`` or ``"mpi"``."""
    timeout: Optional[timedelta] = default_pg_timeout
    """How long a collective may wait before the process group gives up."""
    start_method: str = "auto"
    """``"auto"`` (``"fork"`` in an interactive session, ``"popen"`` otherwise), ``"popen"``,
    ``"spawn"``, ``"fork"`` or ``"forkserver"``."""

    def __post_init__(self) -> None:
        check_choice("process_group_backend", self.process_group_backend, PROCESS_GROUP_BACKENDS)
        check_choice("start_method", self.start_method, START_METHODS)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (for ``DDPStrategy.__init__``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class DDPOptions:
    """How ``DDP`` reduces gradients: torch's ``DistributedDataParallel`` with ``collectives`` in its hook."""

    reduce_op: str = "avg"
    """``"avg"``, ``"sum"`` or ``"adasum"`` (any spelling of ``collectives.ops``); held by its name."""
    bucket_cap_mb: Optional[float] = None
    """``DistributedDataParallel``'s bucket size (None: torch's default)."""
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    skip_nonfinite: bool = False
    """Skip the optimizer step on every rank when any rank's gradients hold NaN/Inf."""

    def __post_init__(self) -> None:
        self.reduce_op = op_name(self.reduce_op, GRADIENT_REDUCE_OPS, argument="reduce_op", default="avg")
        if self.bucket_cap_mb is not None:
            check_positive("bucket_cap_mb", self.bucket_cap_mb)
        check_bool("skip_nonfinite", self.skip_nonfinite)

    def distributed_kwargs(self) -> dict[str, Any]:
        """What ``DistributedDataParallel`` takes of these (``bucket_cap_mb`` only when set)."""
        kwargs: dict[str, Any] = {
            "static_graph": self.static_graph,
            "find_unused_parameters": self.find_unused_parameters,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
        }
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs


@dataclass
class DiLoCoOptions:
    """``DiLoCo``'s own options (its launch options are ``LaunchOptions``)."""

    inner_steps: int = 500
    """Optimizer steps between syncs (H)."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    """In [0, 1)."""
    nesterov: bool = True
    compression: Any = None
    """None, ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"`` or such a ``Compressor`` (checked where it is built)."""
    sync_buffers: bool = True

    def __post_init__(self) -> None:
        check_int("inner_steps", self.inner_steps, 1)
        check_positive("outer_lr", self.outer_lr)
        check_number("outer_momentum", self.outer_momentum, 0, 1, high_open=True)
        check_bool("nesterov", self.nesterov)
        check_bool("sync_buffers", self.sync_buffers)


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
class HorovodOptions:
    """The options of the Horovod strategies (``op`` and ``compression`` are checked by each: what
    ``Horovod`` and ``HorovodAdasum`` accept differs)."""

    op: Any = "average"
    compression: Any = None
    lr_scale: Union[str, float] = "auto"
    """``"auto"`` (the strategy's rule) or a number > 0 multiplying every learning rate once."""
    accelerator: Optional[Any] = None
    checkpoint_io: Optional[Any] = None
    precision_plugin: Optional[Any] = None

    def __post_init__(self) -> None:
        lr_scale = self.lr_scale
        if not (lr_scale == "auto" or (isinstance(lr_scale, (int, float)) and lr_scale > 0)):
            raise ValueError(f"lr_scale={lr_scale!r}; accepted: 'auto' or a number > 0")


@dataclass
class ShardedOptions:
    """``Sharded``'s own options: how gradients cross the shard group and the replica groups."""

    compression: Optional[str] = None
    """The reduce-scatter inside a shard group: None (fp32, what FSDP2 sends), ``"bf16"``, ``"fp16"``
    (cast, reduce-scatter, cast back) or ``"int8"`` (per-block absmax scales, ZeRO++'s qgZ)."""
    int8_block_size: int = 1024
    """Elements per int8 quantisation block (one fp32 scale each)."""
    error_feedback: bool = False
    """int8 only: keep what quantisation dropped and add it to the next step's gradient (a residual
    the size of the unsharded gradients per rank)."""
    replicas: int = 1
    """Replica groups (HSDP's replicate degree); 1 is plain FSDP over all ranks. Must divide the
    world size; each replica group shards the model over world_size / replicas ranks."""
    replica_sync: Any = "none"
    """How the replica groups average their shard gradients: a compressor name of
    ``lightning_dist.compression.COMPRESSORS`` or a ``Compressor`` (checked where it is built)."""
    reduce_op: str = "avg"
    """``"avg"``, or ``"adasum"`` (gradient-space Adasum of the replica groups' shard gradients,
    with ``replica_sync`` ``"none"``, ``"fp16"`` or ``"bf16"``)."""
    async_save: bool = False
    """Write distributed checkpoints in the background: the state is copied to CPU memory, then
    training goes on while the files are written (over a Gloo group of its own); a checkpoint is
    complete before the next save, a load, or the end of the run."""

    def __post_init__(self) -> None:
        if isinstance(self.compression, str):
            self.compression = (
                None if self.compression.lower() in ("none", "fp32") else self.compression.lower()
            )
        check_choice("compression", self.compression, SHARDED_COMPRESSIONS)
        check_int("int8_block_size", self.int8_block_size, 1)
        check_bool("error_feedback", self.error_feedback)
        if self.error_feedback and self.compression != "int8":
            raise ValueError(
                f"error_feedback=True needs compression='int8' (got compression={self.compression!r}); "
                "accepted: error_feedback=False, or compression='int8'"
            )
        check_int("replicas", self.replicas, 1)
        check_bool("async_save", self.async_save)
        self.reduce_op = op_name(self.reduce_op, SHARDED_REDUCE_OPS, argument="reduce_op", default="avg")


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
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    quorum_retries: int = 3
    seed: int = 0
    commit_every: int = 50
    dirpath: Optional[Union[str, os.PathLike[str]]] = None
    keep: int = 3
    start_groups: Optional[int] = None
    """None: ``replica_groups`` (resolved here)."""
    verbose: Optional[bool] = None
    """None: ``$LD_FT_VERBOSE`` (``fault_tolerant_logs``)."""

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
        check_positive("timeout_s", self.timeout_s, owner=owner)
        check_positive("quorum_timeout_s", self.quorum_timeout_s, owner=owner)
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
