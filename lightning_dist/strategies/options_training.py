"""The option groups of how ranks start, sync and shard: Lightning's launch (``LaunchOptions``),
``DDP``, ``DiLoCo``, the Horovod strategies and ``Sharded`` (the shared helpers and vocabularies are
in ``options``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Optional, Union

from torch.distributed.constants import default_pg_timeout

from lightning_dist.algorithms.batch_shares import parse_shares
from lightning_dist.checks import check_bool, check_choice, check_int, check_number, check_positive
from lightning_dist.collectives.ops import op_name
from lightning_dist.strategies.options import (
    GRADIENT_REDUCE_OPS,
    PROCESS_GROUP_BACKENDS,
    SHARDED_COMPRESSIONS,
    SHARDED_REDUCE_OPS,
    START_METHODS,
)

__all__ = [
    "STREAMING_OPTIONS",
    "DDPOptions",
    "DiLoCoOptions",
    "HorovodOptions",
    "LaunchOptions",
    "SharesOptions",
    "ShardedOptions",
]


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


STREAMING_OPTIONS = ("fragments", "fragment_sync_delay", "fragment_update_alpha")
"""``DiLoCoOptions``' Streaming DiLoCo fields: keyword-only in the constructors, after the others."""


@dataclass
class SharesOptions:
    """Each rank's share of the global batch (``lightning_dist.algorithms.batch_shares``)."""

    shares: Any = None
    """None (every rank B/W samples a step, Lightning's sampler), a list of positive numbers (one per
    data-parallel rank, proportions of the global batch B: ``[3, 1]``), ``"balanced"`` or a
    ``Balance(window=..., low=..., high=...)`` (shares from each rank's measured speed)."""

    def __post_init__(self) -> None:
        parse_shares(self.shares)


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
    """None, ``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"``, ``"sparseloco"`` or such a
    ``Compressor`` (checked where it is built)."""
    sync_buffers: bool = True
    fragments: int = 1
    """Streaming DiLoCo's P: the parameters cut into P contiguous fragments (balanced by numel), one
    synced every ``inner_steps / fragments`` steps in turn; must divide ``inner_steps`` (and be at
    most the number of parameters, checked at setup). 1: DiLoCo."""
    fragment_sync_delay: int = 0
    """Streaming DiLoCo's tau: inner steps a fragment's exchange overlaps (started tau steps before it
    lands); in [0, inner_steps / fragments)."""
    fragment_update_alpha: float = 0.0
    """Streaming DiLoCo's alpha: a synced fragment becomes ``alpha * local + (1 - alpha) * global``;
    in [0, 1]."""

    def __post_init__(self) -> None:
        check_int("inner_steps", self.inner_steps, 1)
        check_positive("outer_lr", self.outer_lr)
        check_number("outer_momentum", self.outer_momentum, 0, 1, high_open=True)
        check_bool("nesterov", self.nesterov)
        check_bool("sync_buffers", self.sync_buffers)
        check_int("fragments", self.fragments, 1, self.inner_steps)
        if self.inner_steps % self.fragments:
            raise ValueError(
                f"fragments={self.fragments} must divide inner_steps={self.inner_steps} (each fragment "
                "syncs every inner_steps / fragments steps); accepted: a divisor of inner_steps"
            )
        every = self.inner_steps // self.fragments
        check_int("fragment_sync_delay", self.fragment_sync_delay, 0)
        if self.fragment_sync_delay >= every:
            raise ValueError(
                f"fragment_sync_delay={self.fragment_sync_delay!r} must be an integer in [0, {every - 1}]: "
                f"below inner_steps / fragments = {every}, so a fragment's exchange lands before the next starts"
            )
        check_number("fragment_update_alpha", self.fragment_update_alpha, 0, 1)

    @property
    def streaming(self) -> tuple[int, int, float]:
        """``(fragments, fragment_sync_delay, fragment_update_alpha)``: ``DiLoCoSync``'s last arguments."""
        return self.fragments, self.fragment_sync_delay, float(self.fragment_update_alpha)


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
