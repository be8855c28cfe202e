"""``Horovod`` and ``HorovodAdasum``: Lightning 2.x strategies on Horovod, through ``collectives``.

Processes come from horovodrun, mpirun or srun (one rank each). Gradients are reduced as they
become ready (a post-accumulate-grad hook per parameter launches an async all-reduce, which
Horovod fuses), and waited for before clipping and the optimizer step. With ``op="adasum"`` the
optimizer steps on local gradients and Horovod's Adasum combines the *updates* (p_new - p_old),
as Horovod's own ``DistributedOptimizer`` does for Adasum.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist import collectives
from lightning_dist.collectives.horovod_backend import HorovodBackend
from lightning_dist.compression import COMPRESSORS, Compressor, Exchange
from lightning_dist.strategies.collective_ops import CollectiveOpsMixin
from lightning_dist.strategies.metric_sync import route_metric_sync
from lightning_dist.strategies.options import check_choice, reject_unknown_options

HOROVOD_OPS = ("average", "sum", "adasum")
HOROVOD_COMPRESSIONS = (None, "none", "fp16", "bf16")


class Horovod(CollectiveOpsMixin, ParallelStrategy):
    """Data-parallel training over Horovod (MPI or Gloo controller; NCCL on GPUs when built).

    Args:
        op: ``"average"`` (default), ``"sum"`` or ``"adasum"`` (Horovod's MPI Adasum of optimizer updates).
        compression: ``None``/``"none"``, ``"fp16"`` or ``"bf16"`` (gradients cross the wire in half
            precision), or a ``lightning_dist.compression.Compressor`` whose ``aggregation`` is
            ``"allreduce"`` (its exchange runs at world size 1 and Horovod's all-reduce averages).
        lr_scale: ``"auto"`` follows Horovod's guidance: average -> world size; adasum -> local size
            on GPU (NCCL) and 1 on CPU; sum -> 1. A number overrides it; 1.0 turns scaling off.
            The factor multiplies every optimizer param group's ``lr`` once, at setup.
    """

    strategy_name = "horovod"

    def __init__(
        self,
        op: str = "average",
        compression: Union[None, str, Compressor] = None,
        lr_scale: Union[str, float] = "auto",
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **unknown: Any,
    ) -> None:
        reject_unknown_options(
            type(self).__name__,
            unknown,
            ["op", "compression", "lr_scale", "accelerator", "checkpoint_io", "precision_plugin"],
        )
        check_choice("op", op, HOROVOD_OPS)
        compressor = _horovod_compressor(compression)
        if compressor is not None and op == "adasum":
            raise ValueError(
                f"compression={compression!r} is not supported with op='adasum'; accepted there: None, 'none'"
            )
        if not (lr_scale == "auto" or (isinstance(lr_scale, (int, float)) and lr_scale > 0)):
            raise ValueError(f"lr_scale={lr_scale!r}; accepted: 'auto' or a number > 0")
        super().__init__(
            accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self.op = op
        self.compression = None if compression == "none" else compression
        self.compressor = compressor
        self.lr_scale = lr_scale
        self._backend: Optional[HorovodBackend] = None
        self._sync_grads = True
        self._pending: list[tuple[Tensor, Future, Optional[Exchange]]] = []
        self._hook_handles: list[Any] = []
        self.applied_lr_scale = 1.0

    # -- ranks and devices -----------------------------------------------------------------------
    @property
    def backend(self) -> HorovodBackend:
        if self._backend is None:
            self._backend = HorovodBackend()
        return self._backend

    @property
    @override
    def global_rank(self) -> int:
        return self.backend.rank

    @property
    @override
    def local_rank(self) -> int:
        return self.backend.local_rank

    @property
    @override
    def node_rank(self) -> int:
        return self.backend.node_rank

    @property
    @override
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        device = devices[self.local_rank] if self.local_rank < len(devices) else devices[0]
        if device.type == "cuda":
            return torch.device("cuda", self.local_rank % max(1, torch.cuda.device_count()))
        return device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun / mpirun / srun start the processes

    @override
    def setup_environment(self) -> None:
        collectives.use(collectives.Communicator(self.backend))
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- setup: checks, broadcast, lr scaling, gradient hooks ------------------------------------
    @override
    def setup(self, trainer: L.Trainer) -> None:
        self._check_configuration(trainer)
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        assert self.model is not None
        self._broadcast_module_state()
        route_metric_sync(self.model)
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
            self._scale_learning_rates()
            self._broadcast_optimizer_state()
            if self.op != "adasum":
                self._register_gradient_hooks()
        self.setup_precision_plugin()

    def _check_configuration(self, trainer: L.Trainer) -> None:
        if self.op == "adasum":
            if "16" in str(trainer.precision) and "bf16" not in str(trainer.precision):
                raise ValueError(
                    f"precision={trainer.precision!r} is not supported with op='adasum' (fp16 Adasum loses the "
                    "updates' scale); accepted: '32-true', 'bf16-mixed', 'bf16-true'"
                )
            self.backend.check_adasum(self.root_device.type)

    def _broadcast_module_state(self) -> None:
        assert self.model is not None
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                collectives.broadcast(tensor.data, 0)

    def _broadcast_optimizer_state(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            state = collectives.broadcast_object(optimizer.state_dict(), 0)
            if self.global_rank != 0:
                self.optimizers[i].load_state_dict(state)

    def lr_scale_factor(self) -> float:
        """The factor ``lr_scale`` resolves to for this job (see the class docstring)."""
        if self.lr_scale != "auto":
            return float(self.lr_scale)
        if self.op == "average":
            return float(self.world_size)
        if self.op == "adasum" and self.root_device.type == "cuda":
            return float(self.backend.local_size)
        return 1.0

    def _scale_learning_rates(self) -> None:
        factor = self.lr_scale_factor()
        self.applied_lr_scale = factor
        if factor == 1.0:
            return
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
        for config in self.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def _register_gradient_hooks(self) -> None:
        assert self.model is not None
        op = "avg" if self.op == "average" else "sum"
        self._op = op
        for i, p in enumerate(self.model.parameters()):
            if p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(op, i)))

    def _make_hook(self, op: str, key: int = 0) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            if not self._sync_grads or param.grad is None:
                return
            grad = param.grad
            if self.compressor is None or not grad.is_floating_point():
                self._pending.append((grad, collectives.all_reduce_async(grad, op), None))
                return
            ex = self.compressor.exchange(key, grad, world_size=1)
            rnd = ex.round
            fut = _all_reduce_wire(rnd.payload, op) if rnd is not None else None
            self._pending.append((grad, fut, ex))  # type: ignore[arg-type]

        return hook

    def _wait_for_gradients(self) -> None:
        pending, self._pending = self._pending, []
        for grad, fut, ex in pending:
            if ex is not None:
                if fut is not None:
                    ex.feed(fut.wait())
                while ex.round is not None:
                    ex.feed(_all_reduce_wire(ex.round.payload, self._op).wait())
                assert ex.result is not None
                grad.copy_(ex.result[0])
                continue
            reduced = fut.wait()
            if reduced is not grad and reduced.data_ptr() != grad.data_ptr():
                grad.copy_(reduced)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip communication while Lightning accumulates gradients (one sync per k batches)."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    # -- the step -----------------------------------------------------------------------------------
    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        if self.op == "adasum":
            return self._adasum_step(optimizer, closure, model, **kwargs)

        def closure_then_sync() -> Any:
            result = closure()
            self._wait_for_gradients()  # before Lightning clips gradients and the optimizer steps
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    def _adasum_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any], **kwargs: Any
    ) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        before = [p.detach().clone() for p in params]
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        with torch.no_grad():
            deltas = [p.detach() - b for p, b in zip(params, before)]
            collectives.all_reduce(deltas, "adasum")
            for p, b, d in zip(params, before, deltas):
                p.copy_(b + d)
        return result

    @override
    def teardown(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._pending.clear()
        super().teardown()
        collectives.use(None)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("horovod", cls, description="lightning_dist Horovod (average)")
        strategy_registry.register("horovod_sum", cls, description="lightning_dist Horovod (sum)", op="sum")
        strategy_registry.register(
            "horovod_fp16", cls, description="lightning_dist Horovod, fp16 gradients", compression="fp16"
        )
        strategy_registry.register(
            "horovod_bf16", cls, description="lightning_dist Horovod, bf16 gradients", compression="bf16"
        )


def _horovod_compressor(compression: Any) -> Optional[Compressor]:
    """The compressor for Horovod's ``compression=`` argument (None for no compression)."""
    if isinstance(compression, Compressor):
        if compression.aggregation != "allreduce":
            allowed = ", ".join(n for n, c in COMPRESSORS.items() if c.aggregation == "allreduce")
            raise ValueError(
                f"compression={compression!r} is not supported: Horovod needs an all-reduce compressor; "
                f"accepted: {allowed}"
            )
        return compression
    check_choice("compression", compression, HOROVOD_COMPRESSIONS)
    return None if compression in (None, "none") else COMPRESSORS[compression]()


def _all_reduce_wire(payload: Tensor, op: str) -> Future:
    """All-reduce a compressor's payload. Horovod 0.28 cannot reduce bfloat16 tensors, so bf16 words
    are all-gathered and summed in fp32 (in rank order, so every rank gets the same result) while
    that sends no more than an fp32 ring all-reduce (world size <= 4), else reduced as fp32."""
    if payload.dtype != torch.bfloat16:
        return collectives.all_reduce_async(payload, op)
    w = collectives.current().world_size
    if w > 4:
        return collectives.all_reduce_async(payload.float(), op).then(lambda f: f.value().to(torch.bfloat16))

    def _reduce(f: Future) -> Tensor:
        total = torch.stack(f.value()).view(torch.bfloat16).float().sum(0)
        return (total / w if op == "avg" else total).to(torch.bfloat16)

    return collectives.all_gather_async(payload.view(torch.int16), same_shape=True).then(_reduce)


class HorovodAdasum(Horovod):
    """``Horovod(op="adasum")``: Horovod's MPI Adasum of optimizer updates (launch with MPI)."""

    strategy_name = "horovod_adasum"

    def __init__(self, lr_scale: Union[str, float] = "auto", **kwargs: Any) -> None:
        if "op" in kwargs and kwargs["op"] != "adasum":
            raise ValueError(
                f"op={kwargs['op']!r}: HorovodAdasum always uses 'adasum'; use Horovod(op=...) instead"
            )
        kwargs.pop("op", None)
        super().__init__(op="adasum", lr_scale=lr_scale, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("horovod_adasum", cls, description="lightning_dist Horovod with Adasum")
