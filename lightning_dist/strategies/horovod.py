"""``Horovod``: data-parallel training on Horovod through its communicator, gradients all-reduced.

What it shares with ``HorovodAdasum`` (ranks and devices from Horovod, broadcast at setup, lr scaling)
is ``HorovodBase`` (``horovod_base.py``). Gradients are reduced as they become ready (a
post-accumulate-grad hook per parameter launches an async all-reduce, which Horovod fuses), and
waited for before clipping and the optimizer step. ``HorovodAdasum`` (``horovod_adasum.py``), a
sibling, combines optimizer updates instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Optional, Union

from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives.exchanges import run_exchanges, start_round
from lightning_dist.compression import COMPRESSORS, Compressor, Exchange
from lightning_dist.compression.builder import build_compressor
from lightning_dist.strategies.horovod_base import HOROVOD_OPTIONS, HorovodBase
from lightning_dist.strategies.options import (
    HOROVOD_COMPRESSIONS,
    HOROVOD_OPS,
    normalize_op,
    op_name,
    reject_unknown_options,
)

logger = logging.getLogger(__name__)


class Horovod(HorovodBase):
    """Data-parallel training over Horovod (MPI or Gloo controller; NCCL on GPUs when built).

    Args:
        op: ``"average"`` (default) or ``"sum"`` of the gradients, in any spelling of
            ``lightning_dist.collectives.ops`` (``"avg"``, ``"mean"``, ``ReduceOp.SUM`` ...), kept as
            ``strategy.op`` in Horovod's words. For Horovod's Adasum (of the optimizer updates) use
            ``HorovodAdasum()``; ``op="adasum"`` is refused, pointing there.
        compression: ``None``/``"none"``, ``"fp16"`` or ``"bf16"`` (gradients cross the wire in half
            precision), or a ``lightning_dist.compression.Compressor`` whose ``aggregation`` is
            ``"allreduce"`` (its exchange runs at world size 1 and Horovod's all-reduce averages).
        lr_scale: ``"auto"`` follows Horovod's guidance: average -> world size; sum -> 1. A number
            overrides it; 1.0 turns scaling off. The factor multiplies every optimizer param group's
            ``lr`` once, at setup.
    """

    strategy_name = "ld_horovod"

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
        reject_unknown_options(type(self).__name__, unknown, HOROVOD_OPTIONS)
        if normalize_op(op) == "adasum":
            raise ValueError(
                f"op={op!r} is not supported by Horovod (Horovod's Adasum combines the optimizer updates, "
                "not the gradients); use HorovodAdasum() (strategy 'ld_horovod_adasum') instead"
            )
        # any spelling of collectives.ops ("avg", "mean", ReduceOp.SUM ...); held as Horovod's words
        spelled = {"avg": "average", "sum": "sum"}[op_name(op, HOROVOD_OPS, argument="op")]
        allreduce = [n for n, c in COMPRESSORS.items() if c.aggregation == "allreduce"]
        built = build_compressor(
            compression,
            COMPRESSORS,
            argument="compression",
            accepted=allreduce if isinstance(compression, Compressor) else HOROVOD_COMPRESSIONS,
            refusal=": Horovod needs an all-reduce compressor",
        )
        compressor = None if built.name == "none" else built
        super().__init__(lr_scale, accelerator, checkpoint_io, precision_plugin)
        self.op = spelled
        self.compression = None if compression == "none" else compression
        self.compressor = compressor
        self._sync_grads = True
        self._pending: list[tuple[Tensor, Optional[Future], Optional[Exchange]]] = []
        self._hook_handles: list[Any] = []
        self._reductions: dict[int, int] = {}
        """Per parameter key: all-reduces started since the last wait (names the next one)."""

    # -- gradient hooks -----------------------------------------------------------------------------
    @override
    def _setup_step_sync(self) -> None:
        self._register_gradient_hooks()

    @override
    def _auto_lr_scale(self) -> float:
        return float(self.world_size) if self.op == "average" else 1.0

    def _register_gradient_hooks(self) -> None:
        assert self.model is not None
        for i, p in enumerate(self.model.parameters()):
            if p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
        logger.debug("Horovod: gradient hooks on %d parameters (op=%s)", len(self._hook_handles), self.op)

    def _make_hook(self, key: int) -> Callable[[Tensor], None]:
        """Start the gradient's all-reduce (or its compressor's first round) as soon as it is ready."""
        op = "avg" if self.op == "average" else "sum"
        comm = self._transport

        def hook(param: Tensor) -> None:
            if not self._sync_grads or param.grad is None:
                return
            grad = param.grad
            if self.compressor is None or not grad.is_floating_point():
                # named per parameter, as Horovod's optimizer does: its response cache then skips
                # the negotiation of every gradient after the first step (a second reduction of the
                # same parameter before the step, e.g. two backward passes, gets its own name)
                count = self._reductions.get(key, 0)
                self._reductions[key] = count + 1
                name = f"lightning_dist.grad.{key}" + (f".{count}" if count else "")
                fut = comm().all_reduce_async(grad, op, name=name)
                self._pending.append((grad, fut, None))
                return
            # started for world size 1: Horovod's all-reduce with `op` does the averaging
            ex = self.compressor.exchange(key, grad, world_size=1)
            first = start_round(comm(), [ex], op) if ex.round is not None else None
            self._pending.append((grad, first, ex))

        return hook

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        # The gradients' all-reduces start in their hooks during backward; waiting for them there
        # would spin beside the backward pass (as Horovod's optimizer does, wait once it is done).
        with self.backend.completions_held():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _wait_for_gradients(self) -> None:
        """Finish every exchange (later rounds in hook order, the same on every rank), write back."""
        pending, self._pending = self._pending, []
        self._reductions.clear()
        op = "avg" if self.op == "average" else "sum"
        comm = self._transport()
        chain: Optional[Future] = None
        for _, first, ex in pending:
            if ex is not None:
                chain = run_exchanges(comm, [[ex]], after=chain, inflight=first, all_reduce_op=op)
        if chain is not None:
            chain.wait()
        for grad, fut, ex in pending:
            if ex is not None:
                assert ex.result is not None
                grad.copy_(ex.result[0])
                continue
            assert fut is not None
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
        def closure_then_sync() -> Any:
            result = closure()
            self._wait_for_gradients()  # before Lightning clips gradients and the optimizer steps
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @override
    def teardown(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._pending.clear()
        self._reductions.clear()
        super().teardown()
