"""``DDP``: Lightning's DDP launch and wrapping, with gradient sync routed through ``collectives``."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist.collectives import Communicator, TorchBackend
from lightning_dist.collectives.model_check import check_same_model
from lightning_dist.compat import _IS_INTERACTIVE, _PATH, _init_dist_connection, _SubprocessScriptLauncher
from lightning_dist.strategies.batch_shares import BatchSharesMixin
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.foreign_checkpoints import (
    load_distributed_checkpoint,
    warn_dropped_compressor_state,
)
from lightning_dist.strategies.fork_launcher import checked_launcher
from lightning_dist.strategies.launch_needs import LIGHTNING
from lightning_dist.strategies.names import register_class
from lightning_dist.strategies.nonfinite import NonFiniteGuard
from lightning_dist.strategies.options import option_names, options_from, reject_unknown_options
from lightning_dist.strategies.options_training import DDPOptions, LaunchOptions, SharesOptions
from lightning_dist.wire.comm_hook import CollectivesHookState, collectives_hook

logger = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 5.0
"""Seconds rank 0 of Lightning's launcher waits, after an exception, for its child ranks to end by
themselves before it kills them."""


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it cannot end by itself."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class DDP(BatchSharesMixin, CollectiveOpsMixin, DDPStrategy):
    """torch DistributedDataParallel under Lightning, with every bucket reduced by ``collectives``.

    Unlike Lightning's ``DDPStrategy``, the comm hook is registered on CPU as well as CUDA, so
    monitoring, Adasum and compression behave the same on Gloo and NCCL.

    Args:
        reduce_op: how gradients are combined: ``"avg"`` (what torch DDP does), ``"sum"``, or
            ``"adasum"`` (gradient-space Adasum per parameter tensor; with SGD it equals Horovod's
            Adasum, with Adam it is a different algorithm than Horovod's update-space one). Other
            spellings (``"mean"``, ``"average"``, ``ReduceOp.SUM`` ...): ``lightning_dist.collectives.ops``.
        start_method: ``"auto"`` picks ``"fork"`` in an interactive session (notebooks) and
            ``"popen"`` (the script re-executed per rank, like Lightning's ``"ddp"``) otherwise.
        bucket_cap_mb, static_graph, find_unused_parameters: passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: passed to ``DistributedDataParallel``; on by default (torch's is
            off): gradients live in the communication buckets, which saves copying every gradient
            back after the reduction and the memory of one set of gradients; that more than pays for
            the division pass a comm hook makes (torch's hook-less reducer folds it into its copy
            into the bucket). Pass ``False`` when code replaces ``param.grad`` or calls ``detach_()`` on it.
        skip_nonfinite: when any rank's gradients hold NaN/Inf, skip that optimizer step on every
            rank (one flag all-reduced per step; logged as ``skipped_nonfinite_steps``).
        shares: each rank's share of the global batch: None (uniform, Lightning's sampler), a list of
            proportions (``[3, 1]``), ``"balanced"`` or a ``Balance(...)`` (docs/uneven-ranks.md).
    """

    strategy_name = "ld_ddp"
    launch_needs = LIGHTNING

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["auto", "popen", "spawn", "fork", "forkserver"] = "auto",
        reduce_op: str = "avg",
        bucket_cap_mb: Optional[float] = None,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        skip_nonfinite: bool = False,
        shares: Any = None,
        **unknown: Any,
    ) -> None:
        reject_unknown_options(type(self).__name__, unknown, self._accepted_options())
        launch = options_from(LaunchOptions, locals())  # checks them
        options = options_from(DDPOptions, locals())
        shares_options = options_from(SharesOptions, locals())
        if launch.start_method == "auto":
            launch.start_method = "fork" if _IS_INTERACTIVE else "popen"
        super().__init__(**launch.as_kwargs(), **options.distributed_kwargs())
        self.reduce_op = options.reduce_op
        self.hook_state = self._make_hook_state()
        self.nonfinite = NonFiniteGuard() if options.skip_nonfinite else None
        self._init_shares(shares_options.shares)

    @classmethod
    def _accepted_options(cls) -> list[str]:
        """The keyword options this class accepts (named in the unknown-option error)."""
        return option_names(LaunchOptions, DDPOptions, SharesOptions)

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # fork: refuse when CUDA is already initialised; under torchrun/run_elastic/SLURM: no relaunch
        self._launcher = checked_launcher(self, self._launcher, type(self).__name__)

    # -- gradient communication -------------------------------------------------------------------
    def _make_hook_state(self) -> Any:
        return CollectivesHookState(reduce_op=self.reduce_op)

    def _comm_hook(self) -> Callable[[Any, Any], Any]:
        return collectives_hook

    @override
    def setup_environment(self) -> None:
        from lightning_dist.preflight.slurm import check_ddp_under_slurm

        check_ddp_under_slurm(self)  # SLURM tasks vs devices/num_nodes, before the group forms
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        # Lightning's DDPStrategy.setup_distributed, with ``_process_group_kwargs`` as an extension point
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout, **self._process_group_kwargs()}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._set_communicator(Communicator(TorchBackend()))
        logger.debug(
            "%s: process group ready (rank %d of %d, backend %s); communicator made",
            type(self).__name__,
            self.global_rank,
            self.world_size,
            self._get_process_group_backend(),
        )

    @override
    def setup(self, trainer: Any) -> None:
        # before DistributedDataParallel (or, outside fit, the module-state broadcast) touches the model
        assert self.model is not None
        check_same_model(self.model, type(self).__name__, self._transport())
        super().setup(trainer)

    def _process_group_kwargs(self) -> dict[str, Any]:
        """Extra ``init_process_group`` arguments (a subclass may pass a ``store``)."""
        return {}

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state.comm = self._transport()  # the hook's transport: this strategy's communicator
        self.model.register_comm_hook(self.hook_state, self._comm_hook())
        logger.debug(
            "%s: comm hook %s registered on %s",
            type(self).__name__,
            self._comm_hook().__name__,
            self.root_device,
        )

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        guard = self.nonfinite
        if guard is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        step = module.trainer.global_step if module is not None and module._trainer is not None else -1
        wrapped = guard.wrap(optimizer, closure, step, self._transport())
        result = super().optimizer_step(optimizer, wrapped, model, **kwargs)
        if module is not None and module._current_fx_name is not None:
            module.log("skipped_nonfinite_steps", float(guard.skipped), on_step=True, on_epoch=False)
        return result

    # -- checkpoints another strategy wrote ---------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint file, or the distributed checkpoint directory ``Sharded`` writes, loaded whole
        (``foreign_checkpoints``); a compressor's state this strategy does not read is named."""
        path = Path(str(checkpoint_path))
        if path.is_dir():
            checkpoint = load_distributed_checkpoint(
                path,
                type(self).__name__,
                lambda meta: self.checkpoint_io.load_checkpoint(meta, weights_only=weights_only),
            )
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if not self.reads_compressor_state():
            warn_dropped_compressor_state(checkpoint, type(self).__name__)
        return checkpoint

    def reads_compressor_state(self) -> bool:
        """Whether this strategy loads ``Compressed``'s compressor state from a checkpoint:
        ``Compressed`` and its subclasses do (``load_compressor_state``)."""
        return callable(getattr(self, "load_compressor_state", None))

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(self.launcher, _SubprocessScriptLauncher):
            # rank 0 of Lightning's launcher: its child ranks must not outlive it. Ranks that hit the
            # same error end by themselves (and report it); a stopped or hung one is killed.
            deadline = time.monotonic() + CHILD_EXIT_GRACE_S
            for proc in self.launcher.procs:
                if not _is_stopped(proc.pid):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            self.launcher.kill(signal.SIGKILL)
        super().on_exception(exception)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_class(strategy_registry, cls)  # the names in strategies/names.py that build this class
