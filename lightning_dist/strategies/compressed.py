"""``Compressed``: ``DDP`` whose comm hook sends each gradient bucket through a compressor.

    L.Trainer(strategy=Compressed("powersgd", rank=4))       # or Compressed(PowerSGD(rank=4))
    L.Trainer(strategy=Compressed("fp16", reduce_op="adasum"))
    L.Trainer(strategy="compressed_int8")

PowerSGD starts after an uncompressed warm-up (``warmup="auto"``: the first 10% of the Trainer's
steps, as torch advises for its PowerSGD hook; ``warmup=0`` compresses from the first step).

Compressor state (error-feedback residuals, warm-start factors, momentum, step counters) differs per
rank; checkpoints hold every rank's copy and the bucket layout it belongs to, and a resumed run
loads its own rank's entry, so it continues as if never stopped. DDP's first backward pass uses one
pre-rebuild bucket; a resumed run splits it into the checkpointed layout's keys. Limits: a checkpoint
taken after the very first optimizer step (before DDP rebuilt its buckets) does not resume exactly,
and one resumed at another world size merges the saved ranks' states (with a warning).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist.algorithms.cpu_state import to_cpu
from lightning_dist.compression import COMPRESSORS, Compressor
from lightning_dist.compression.builder import build_compressor
from lightning_dist.state import RankStates
from lightning_dist.strategies.ddp import DDP
from lightning_dist.strategies.options import COMPRESSED_REDUCE_OPS, op_name
from lightning_dist.strategies.rank_state import RankStateMixin
from lightning_dist.warn import warn_once
from lightning_dist.wire.compressed_hook import CompressedHookState, compressed_hook

logger = logging.getLogger(__name__)

AUTO_WARMUP_UNBOUNDED = 1000
"""``warmup="auto"``'s steps for a run without an end (torch's default ``start_powerSGD_iter``)."""
CHECKPOINT_KEY = "lightning_dist.compressed"
COMPRESSOR_STATES = RankStates(CHECKPOINT_KEY, "Compressed", "the checkpoint has no compressor state")
"""Checkpoint entry: ``{"world_size": W, "compressor": name, "ranks": [rank r's
``compressor_checkpoint_state()``]}``."""


class Compressed(RankStateMixin, DDP):
    """Data-parallel training with compressed gradients, on Gloo or NCCL, through its communicator.

    Args:
        compressor: a name (``"none"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk"``, ``"powersgd"``,
            ``"sign"``, ``"demo"``) or a ``lightning_dist.compression.Compressor`` instance.
        reduce_op: ``"avg"``, or ``"adasum"`` (per parameter tensor, in gradient space) for the
            compressors whose ``supports_adasum`` is true.
        log_stats: log ``compression/bytes_per_step`` (bytes this rank sent for the gradients, from
            its communicator's counters) and ``compression/ratio`` (those bytes over a ring all-reduce of
            the fp32 gradients) at every optimizer step.
        warmup: optimizer steps whose gradients are averaged uncompressed (exactly as ``DDP()``)
            before the compressor starts; ``"auto"`` (default): the compressor's ``warmup_fraction``
            of the Trainer's ``estimated_stepping_batches``, rounded up (PowerSGD: 10%, torch's
            guidance for its PowerSGD hook; the other compressors: 0), or ``AUTO_WARMUP_UNBOUNDED``
            steps for a run with no end, and 0 when the compressor has a warm-up of its own
            (PowerSGD's ``start_step``); ``0`` compresses from the first step. Counted from
            ``trainer.global_step``, so a resumed run goes on where it stopped.
        **options: the compressor's options (``rank=4``) and ``DDP``'s (``bucket_cap_mb``, ``start_method`` ...).
    """

    strategy_name = "ld_compressed"

    def __init__(
        self,
        compressor: Union[str, Compressor] = "powersgd",
        *,
        reduce_op: str = "avg",
        log_stats: bool = True,
        warmup: Union[int, str] = "auto",
        **options: Any,
    ) -> None:
        if warmup != "auto" and not (
            isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0
        ):
            raise ValueError(
                f"warmup={warmup!r} is not supported; accepted: 'auto' or an integer >= 0 (optimizer steps "
                "averaged uncompressed before the compressor starts; 0: compress from the first step)"
            )
        self.warmup = warmup
        self.warmup_steps: Optional[int] = None
        """The warm-up in optimizer steps (``warmup`` with ``"auto"`` resolved at the first backward)."""
        ddp_names = set(DDP._accepted_options())
        ddp_options = {k: v for k, v in options.items() if k in ddp_names}
        self.compressor = build_compressor(
            compressor,
            COMPRESSORS,
            options={k: v for k, v in options.items() if k not in ddp_names},
            owner="Compressed",
            strategy_options=Compressed._accepted_options()[1:],
        )
        op = op_name(reduce_op, COMPRESSED_REDUCE_OPS, argument="reduce_op", default="avg")
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
        self.training_state.register(
            "compressor",
            self._compressor_piece,
            per_rank=True,
            checkpoint=COMPRESSOR_STATES,
            fields=self._compressor_fields,
        )

    @classmethod
    @override
    def _accepted_options(cls) -> list[str]:
        return [
            "compressor",
            "reduce_op",
            "log_stats",
            "warmup",
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

    # -- warm-up ------------------------------------------------------------------------------------
    def resolve_warmup(self, trainer: Any) -> int:
        """``warmup`` in optimizer steps for ``trainer``'s run (see the class docstring)."""
        if self.warmup != "auto":
            return int(self.warmup)
        fraction = self.compressor.warmup_fraction
        if fraction <= 0 or getattr(self.compressor.config, "start_step", 0) > 0:
            return 0
        total = float(trainer.estimated_stepping_batches)
        return AUTO_WARMUP_UNBOUNDED if math.isinf(total) else math.ceil(fraction * total)

    def _set_warmup(self) -> None:
        """Before a backward pass: whether this optimizer step's buckets go uncompressed."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            self.hook_state.uncompressed = False
            return
        if self.warmup_steps is None:
            self.warmup_steps = self.resolve_warmup(trainer)
            if self.warmup_steps:
                rank_zero_info(
                    f"Compressed: the first {self.warmup_steps} optimizer steps average the gradients "
                    f"uncompressed, then {self.compressor.name} starts (warmup={self.warmup!r}; warmup=0 "
                    "compresses from the first step)"
                )
        self.hook_state.uncompressed = trainer.global_step < self.warmup_steps

    # -- accounting ---------------------------------------------------------------------------------
    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        self._set_warmup()
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

    # -- checkpoints: every rank's compressor state (lightning_dist.strategies.rank_state) ---------
    def compressor_checkpoint_state(self) -> dict[str, Any]:
        """This rank's compressor state and the bucket layout its keys refer to (CPU tensors)."""
        state: CompressedHookState = self.hook_state
        layout = state.layout or state.planned or {}
        return {"state": to_cpu(self.compressor.state_dict()), "layout": dict(layout)}

    def _compressor_piece(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        return self.compressor_checkpoint_state()

    def _compressor_fields(self) -> dict[str, Any]:
        return {"compressor": self.compressor.name}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        self.load_compressor_state(checkpoint.get(CHECKPOINT_KEY))

    def load_compressor_state(self, saved: Optional[Mapping[str, Any]]) -> None:
        """Load this rank's entry of a checkpoint's compressor states: at another world size every
        rank gets the saved ranks' merged state, without the entry (or of another compressor) the
        compressor starts afresh; either with a warning."""
        state: CompressedHookState = self.hook_state
        problem = None
        if saved is None:
            problem = COMPRESSOR_STATES.missing
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
        fallback = (
            f"the compressor states of its {len(ranks)} ranks are merged into one (Compressor.merge_states), "
            "so the compressor does not continue exactly as on the saved ranks"
        )
        held = any(r["state"].get("keys") for r in ranks)  # merging no state drops nothing: no warning
        own = COMPRESSOR_STATES.select(saved, self.global_rank, self.world_size, fallback, warn=held)
        if own is not None:
            self.compressor.load_state_dict(own["state"])
        else:  # another world size: every rank gets the ranks' merged state
            own = ranks[0]
            self.compressor.load_state_dict(self.compressor.merge_states([r["state"] for r in ranks]))
        state.planned = {int(k): [int(i) for i in v] for k, v in own["layout"].items()} or None
        state.layout = {}
