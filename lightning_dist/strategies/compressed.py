"""``Compressed``: ``DDP`` whose comm hook sends each gradient bucket through a compressor.

    L.Trainer(strategy=Compressed("powersgd", rank=4))       # or Compressed(PowerSGD(rank=4))
    L.Trainer(strategy=Compressed("fp16", reduce_op="adasum"))
    L.Trainer(strategy="compressed_int8")

Compressor state (error-feedback residuals, warm-start factors, momentum, step counters) differs per
rank; checkpoints hold every rank's copy and the bucket layout it belongs to, and a resumed run
loads its own rank's entry, so it continues as if never stopped. DDP's first backward pass uses one
pre-rebuild bucket; a resumed run splits it into the checkpointed layout's keys. Limits: a checkpoint
taken after the very first optimizer step (before DDP rebuilt its buckets) does not resume exactly,
and one resumed at another world size starts the compressor afresh (with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist.compat import _PATH
from lightning_dist.compression import COMPRESSORS, Compressor
from lightning_dist.strategies.compressed_hook import CompressedHookState, compressed_hook
from lightning_dist.strategies.cpu_state import to_cpu
from lightning_dist.strategies.ddp import DDP
from lightning_dist.strategies.options import reduce_op_name
from lightning_dist.strategies.registry import register
from lightning_dist.warn import warn_once

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_dist.compressed"
COMPRESSED_REDUCE_OPS = ("avg", "adasum")


def build_compressor(compressor: Union[str, Compressor], options: Mapping[str, Any]) -> Compressor:
    """``compressor`` itself, or the named one built with ``options``; ValueError naming what is wrong."""
    strategy_options = ", ".join(Compressed._accepted_options()[1:])
    if isinstance(compressor, Compressor):
        if options:
            raise ValueError(
                f"Compressed got unknown option(s) {', '.join(sorted(options))}; a Compressor instance takes "
                f"its options itself; strategy options: {strategy_options}"
            )
        return compressor
    if not isinstance(compressor, str) or compressor.lower() not in COMPRESSORS:
        raise ValueError(f"compressor={compressor!r} is not known; accepted: {', '.join(COMPRESSORS)}")
    try:
        return COMPRESSORS[compressor.lower()](**options)
    except ValueError as err:
        if "unknown option" in str(err):
            raise ValueError(f"{err}; strategy options: {strategy_options}") from None
        raise


class Compressed(DDP):
    """Data-parallel training with compressed gradients, on Gloo or NCCL, through its communicator.

    Args:
        compressor: a name (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk"``, ``"powersgd"``,
            ``"sign"``, ``"demo"``) or a ``lightning_dist.compression.Compressor`` instance.
        reduce_op: ``"avg"``, or ``"adasum"`` (per parameter tensor, in gradient space) for the
            compressors whose ``supports_adasum`` is true.
        log_stats: log ``compression/bytes_per_step`` (bytes this rank sent for the gradients, from
            its communicator's counters) and ``compression/ratio`` (those bytes over a ring all-reduce of
            the fp32 gradients) at every optimizer step.
        **options: the compressor's options (``rank=4``) and ``DDP``'s (``bucket_cap_mb``, ``start_method`` ...).
    """

    strategy_name = "ld_compressed"

    def __init__(
        self,
        compressor: Union[str, Compressor] = "powersgd",
        *,
        reduce_op: str = "avg",
        log_stats: bool = True,
        **options: Any,
    ) -> None:
        ddp_names = set(DDP._accepted_options())
        ddp_options = {k: v for k, v in options.items() if k in ddp_names}
        self.compressor = build_compressor(
            compressor, {k: v for k, v in options.items() if k not in ddp_names}
        )
        op = reduce_op_name("reduce_op", reduce_op, COMPRESSED_REDUCE_OPS)
        if op == "adasum" and not self.compressor.supports_adasum:
            allowed = ", ".join(n for n, c in COMPRESSORS.items() if c.supports_adasum)
            raise ValueError(
                f"reduce_op='adasum' is not supported by compressor {self.compressor.name!r}; "
                f"compressors that allow it: {allowed}"
            )
        if not isinstance(log_stats, bool):
            raise ValueError(f"log_stats={log_stats!r} is not supported; accepted: True, False")
        self.log_stats = log_stats
        self.last_step_stats: dict[str, float] = {}
        self._step_bytes = 0
        super().__init__(reduce_op=op, **ddp_options)

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        return [
            "compressor",
            "reduce_op",
            "log_stats",
            *(o for o in DDP._accepted_options() if o != "reduce_op"),
        ]

    @override
    def _make_hook_state(self) -> CompressedHookState:
        return CompressedHookState(compressor=self.compressor, adasum=self.reduce_op == "adasum")

    @override
    def _comm_hook(self) -> Callable[[Any, Any], Any]:
        return compressed_hook

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.hook_state.param_index = {id(p): i for i, p in enumerate(self.model.module.parameters())}
        super()._register_ddp_hooks()
        logger.debug("Compressed: %r on %d parameters", self.compressor, len(self.hook_state.param_index))

    # -- accounting ---------------------------------------------------------------------------------
    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        stats = self._transport().stats
        before = stats.bytes_sent
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._step_bytes += stats.bytes_sent - before
        return loss

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Optional[Any] = None, **kwargs: Any
    ) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        state: CompressedHookState = self.hook_state
        sent, reference = self._step_bytes, state.reference_bytes
        self._step_bytes = state.reference_bytes = 0
        self.last_step_stats = {
            "bytes_per_step": float(sent),
            "reference_bytes": float(reference),
            "ratio": sent / reference if reference else float("nan"),
        }
        module = self.lightning_module
        if self.log_stats and reference and module is not None and module._current_fx_name is not None:
            module.log_dict(
                {
                    "compression/bytes_per_step": float(sent),
                    "compression/ratio": self.last_step_stats["ratio"],
                },
                on_step=True,
                on_epoch=False,
                sync_dist=False,
            )
        return result

    # -- checkpoints --------------------------------------------------------------------------------
    def compressor_checkpoint_state(self) -> dict[str, Any]:
        """This rank's compressor state and the bucket layout its keys refer to (CPU tensors)."""
        state: CompressedHookState = self.hook_state
        layout = state.layout or state.planned or {}
        return {"state": to_cpu(self.compressor.state_dict()), "layout": dict(layout)}

    def gather_per_rank(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank (called on all ranks)."""
        comm = self._transport()
        return [
            comm.broadcast_object(obj if self.global_rank == r else None, r) for r in range(self.world_size)
        ]

    def compressor_checkpoint(self, ranks: Any) -> dict[str, Any]:
        """The checkpoint entry for every rank's ``compressor_checkpoint_state`` (in rank order)."""
        return {
            CHECKPOINT_KEY: {
                "compressor": self.compressor.name,
                "world_size": self.world_size,
                "ranks": list(ranks),
            }
        }

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Gather every rank's compressor state into the checkpoint (called on all ranks)."""
        if "optimizer_states" in checkpoint:
            ranks = self.gather_per_rank(self.compressor_checkpoint_state())
            checkpoint = {**checkpoint, **self.compressor_checkpoint(ranks)}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.load_compressor_state(checkpoint.get(CHECKPOINT_KEY))

    def load_compressor_state(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Load this rank's entry of a checkpoint's compressor states (warns and starts fresh if unusable)."""
        state: CompressedHookState = self.hook_state
        problem = None
        if saved is None:
            problem = "the checkpoint has no compressor state"
        elif saved.get("compressor") != self.compressor.name:
            problem = (
                f"the checkpoint's compressor is {saved.get('compressor')!r}, not {self.compressor.name!r}"
            )
        if problem is not None:
            # the same on every rank: shown once, by rank 0
            warn_once(f"Compressed: {problem}; the compressor starts afresh", stacklevel=2)
            self.compressor.reset()
            state.planned = None
            return
        assert saved is not None
        ranks = saved["ranks"]
        if saved.get("world_size") == self.world_size:
            entry = ranks[self.global_rank]
            self.compressor.load_state_dict(entry["state"])
        else:  # another world size: every rank gets the ranks' merged state (see Compressor.merge_states)
            entry = ranks[0]
            self.compressor.load_state_dict(self.compressor.merge_states([r["state"] for r in ranks]))
            logger.info(
                "Compressed: compressor state of %d ranks merged for world size %d",
                len(ranks),
                self.world_size,
            )
        state.planned = {int(k): [int(i) for i in v] for k, v in entry["layout"].items()} or None
        state.layout = {}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name in COMPRESSORS:
            register(
                strategy_registry,
                f"ld_compressed_{name}",
                cls,
                f"DDP with {name} gradient compression"
                if name != "none"
                else "Compressed's path, no compression",
                deprecated=f"compressed_{name}",
                compressor=name,
            )
