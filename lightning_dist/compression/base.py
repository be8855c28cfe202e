"""Compressor interface: rounds of payloads a transport aggregates, and per-key state behind them.

A compressor never talks to a transport. ``Compressor.exchange(key, tensors, world_size=W, rank=r)``
returns an ``Exchange``; whoever drives it (a DDP comm hook, ``simulate``) repeats::

    while (rnd := ex.round) is not None:
        ex.feed(<rnd.payload aggregated across ranks as rnd.kind says>)
    ex.result  # tensors shaped and typed like ``tensors``: the (compressed) average over ranks

Round kinds, and what ``feed`` expects back:
  allreduce   the payload reduced over ranks with ``rnd.op`` ("sum", or "adasum" if asked for)
  allgather   every rank's payload (equal shapes everywhere) in rank order: a list or stacked tensor
  all_to_all  the payload has shape [W, ...] and row j goes to rank j; feed the rows received, row i
              from rank i (a list or stacked tensor)

Each round is one tensor, so a driver makes exactly one collective per round. Payloads are fresh
tensors that the driver may reduce in place.

Wire model (bytes one rank sends, N = payload bytes, W = world size), as the collectives count them:
  allreduce  2*(W-1)*N // W (ring);  allgather  (W-1)*N;  all_to_all  (W-1)*N // W.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Optional, TypeVar, Union

import torch
from torch import Tensor

Key = Union[int, str]
RoundKind = Literal["allreduce", "allgather", "all_to_all"]
Aggregation = Literal["allreduce", "allgather", "all_to_all"]
Rounds = Generator["Round", Tensor, list[Tensor]]
Shape = Sequence[int]

ALIGN = 8
"""Every segment of a packed byte payload starts at a multiple of this many bytes."""


# -- wire model ---------------------------------------------------------------------------------
def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` (reduce-scatter then all-gather)."""
    return 0 if world_size <= 1 else 2 * (world_size - 1) * nbytes // world_size


def allgather_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all-gather of an ``nbytes`` payload."""
    return 0 if world_size <= 1 else (world_size - 1) * nbytes


def all_to_all_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all-to-all of an ``nbytes`` payload split in W equal rows."""
    return 0 if world_size <= 1 else (world_size - 1) * nbytes // world_size


def reference_bytes(shapes: Sequence[Shape], world_size: int) -> int:
    """The baseline: bytes one rank sends in a ring all-reduce of these tensors in fp32."""
    return ring_allreduce_bytes(4 * sum(math.prod(s) for s in shapes), world_size)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


# -- rounds and exchanges -----------------------------------------------------------------------
@dataclass
class Round:
    """One collective: ``payload`` aggregated across ranks as ``kind`` says."""

    kind: RoundKind
    payload: Tensor
    op: Literal["sum", "adasum"] = "sum"

    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size()

    def wire_bytes(self, world_size: int) -> int:
        """Bytes this rank sends for the round (for ``op="adasum"``: the ring estimate)."""
        n = self.nbytes()
        if self.kind == "allreduce":
            return ring_allreduce_bytes(n, world_size)
        if self.kind == "allgather":
            return allgather_bytes(n, world_size)
        return all_to_all_bytes(n, world_size)


class Exchange:
    """One call's trip through a compressor: the rounds still to run, then ``result``."""

    def __init__(self, rounds: Rounds, world_size: int) -> None:
        self._rounds = rounds
        self.world_size = world_size
        self.round: Optional[Round] = None
        self.result: Optional[list[Tensor]] = None
        self.wire_bytes = 0
        """Bytes this rank has sent so far, by the wire model."""
        self.num_rounds = 0
        self._advance(None)

    @property
    def done(self) -> bool:
        return self.round is None

    def _advance(self, received: Optional[Tensor]) -> None:
        try:
            rnd = next(self._rounds) if received is None else self._rounds.send(received)
        except StopIteration as stop:
            self.round = None
            self.result = stop.value
            return
        self.round = rnd
        self.num_rounds += 1
        self.wire_bytes += rnd.wire_bytes(self.world_size)

    def feed(self, received: Union[Tensor, Sequence[Tensor]]) -> None:
        """Hand back the aggregated payload of the current round (see the module docstring)."""
        rnd = self.round
        if rnd is None:
            raise RuntimeError("feed: this exchange is finished; read .result")
        if isinstance(received, Tensor):
            value = received
        else:
            if rnd.kind == "allreduce":
                raise ValueError("feed: an allreduce round takes the reduced tensor, not a list")
            value = torch.stack(list(received))
        if rnd.kind != "allreduce" and value.shape[0] != self.world_size:
            raise ValueError(
                f"feed: a {rnd.kind} round needs one row per rank ({self.world_size}), got {value.shape[0]}"
            )
        self._advance(value)

    def run_local(self) -> list[Tensor]:
        """Finish as the only rank (world size 1): every collective is the identity."""
        if self.world_size != 1:
            raise RuntimeError(f"run_local: this exchange was started for world size {self.world_size}")
        while self.round is not None:
            p = self.round.payload
            self.feed(p.unsqueeze(0) if self.round.kind == "allgather" else p)
        assert self.result is not None
        return self.result


def simulate(exchanges: Sequence[Exchange]) -> list[list[Tensor]]:
    """Drive one exchange per rank (index = rank) in lockstep, aggregating in process."""
    if any(ex.world_size != len(exchanges) for ex in exchanges):
        raise ValueError(f"simulate: every exchange must be started with world_size={len(exchanges)}")
    while True:
        rounds = [ex.round for ex in exchanges]
        if all(r is None for r in rounds):
            break
        if any(r is None for r in rounds) or len({(r.kind, r.op) for r in rounds if r is not None}) != 1:
            raise RuntimeError("simulate: ranks disagree on the next round")
        kind, op = rounds[0].kind, rounds[0].op  # type: ignore[union-attr]
        payloads = [r.payload for r in rounds]  # type: ignore[union-attr]
        if kind == "allreduce":
            if op != "sum":
                raise ValueError(f"simulate: op={op!r} is not simulated; accepted: sum")
            total = payloads[0].clone()
            for p in payloads[1:]:
                total += p
            for ex in exchanges:
                ex.feed(total.clone())
        elif kind == "allgather":
            stacked = torch.stack(payloads)
            for ex in exchanges:
                ex.feed(stacked.clone())
        else:
            for j, ex in enumerate(exchanges):
                ex.feed(torch.stack([p[j] for p in payloads]))
    return [ex.result for ex in exchanges]  # type: ignore[misc]


# -- tensor helpers -----------------------------------------------------------------------------
def flatten_fp32(tensors: Sequence[Tensor]) -> Tensor:
    """One flat fp32 vector of all tensors (a view, not a copy, for a single fp32 tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1).float()
    return torch.cat([t.reshape(-1).float() for t in tensors])


def flatten_native(tensors: Sequence[Tensor]) -> Tensor:
    """One flat vector in the tensors' own dtype."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split ``flat`` into tensors shaped and typed like ``like``."""
    out: list[Tensor] = []
    offset = 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view(t.shape).to(t.dtype))
        offset += n
    return out


def pack(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors shaped [*lead, k_i] into one uint8 [*lead, bytes], each segment aligned."""
    lead = parts[0].shape[:-1]
    pieces: list[Tensor] = []
    for p in parts:
        b = p.contiguous().view(torch.uint8)
        pad = aligned(b.shape[-1]) - b.shape[-1]
        pieces.append(b)
        if pad:
            pieces.append(torch.zeros((*lead, pad), dtype=torch.uint8, device=b.device))
    return torch.cat(pieces, dim=-1)


def unpack(buf: Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[Tensor]:
    """Inverse of ``pack``: views [*lead, k_i] of each ``(dtype, k_i)`` segment of ``buf``."""
    out: list[Tensor] = []
    offset = 0
    for dtype, k in specs:
        n = k * torch.empty((), dtype=dtype).element_size()
        out.append(buf[..., offset : offset + n].view(dtype))
        offset += aligned(n)
    if offset != buf.shape[-1]:
        raise ValueError(f"unpack: payload has {buf.shape[-1]} bytes per row, expected {offset}")
    return out


def packed_bytes(specs: Sequence[tuple[torch.dtype, int]]) -> int:
    return sum(aligned(k * torch.empty((), dtype=d).element_size()) for d, k in specs)


def all_finite(*tensors: Tensor) -> Tensor:
    """A 0-d bool tensor, True when every entry is finite (no host sync)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)


def keep_if(ok: Tensor, new: Tensor, old: Optional[Tensor]) -> Tensor:
    """``new`` where ``ok`` else ``old`` (zeros when there is none): state survives a skipped step."""
    return torch.where(ok, new, torch.zeros((), device=new.device) if old is None else old)


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (unlike ``hash`` of a str)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF


def generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    return tree


# -- configs ------------------------------------------------------------------------------------
C = TypeVar("C")


def build_config(owner: str, config_cls: type[C], config: Optional[C], options: dict[str, Any]) -> C:
    """``config`` or ``config_cls(**options)``; unknown options raise ValueError naming the accepted."""
    if config is not None:
        if options:
            raise ValueError(f"{owner}: pass either a config or options, not both")
        if not isinstance(config, config_cls):
            raise ValueError(f"{owner}: config must be a {config_cls.__name__}, got {type(config).__name__}")
        return config
    accepted = [f.name for f in fields(config_cls)]  # type: ignore[arg-type]
    for name in options:
        if name not in accepted:
            raise ValueError(
                f"{owner}: unknown option {name!r}; accepted: {', '.join(accepted) if accepted else 'none'}"
            )
    return config_cls(**options)


def check_int(owner: str, name: str, value: Any, low: int, high: Optional[int] = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"{owner}: {name}={value!r} must be {bound}")


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name}={value!r} must be True or False")


@dataclass
class NoOptions:
    """Compressors without options."""


# -- the interface ------------------------------------------------------------------------------
@dataclass
class Context:
    """What an exchange knows about the world it runs in."""

    world_size: int
    rank: int
    adasum: bool


class Compressor(ABC):
    """A gradient compressor: rounds of payloads in, the averaged tensors out, state in between.

    State is kept per ``key`` (a DDP bucket index, a parameter name): plain tensors and ints, saved
    by ``state_dict`` and restored by ``load_state_dict`` so a resumed run continues exactly. When
    the shapes seen under a key change (DDP rebuilds its buckets after the first step), that key's
    tensors are dropped and start afresh; its step counter is kept.

    Non-finite gradients (fp16 loss scaling overflows) come out non-finite, so a GradScaler skips the
    step, and leave the state (residuals, momentum, factors) as it was before the step.
    """

    name: ClassVar[str]
    aggregation: ClassVar[Aggregation]
    """The collective its rounds use ("allreduce" compressors are Horovod-compatible)."""
    supports_adasum: ClassVar[bool] = False
    """Whether ``exchange(..., adasum=True)`` is allowed (its allreduce rounds then ask op="adasum")."""
    per_tensor: ClassVar[bool] = False
    """Whether it needs each parameter's gradient with its shape (``bucket.gradients()``); when
    False the flat bucket (``[bucket.buffer()]``) is the cheaper input, with the same result."""

    config: Any

    def __init__(self) -> None:
        self._state: dict[Key, dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def exchange(
        self,
        key: Key,
        tensors: Union[Tensor, Sequence[Tensor]],
        *,
        world_size: int = 1,
        rank: int = 0,
        adasum: bool = False,
    ) -> Exchange:
        """Start compressing ``tensors`` (one bucket) under ``key``; drive the returned exchange."""
        check_int(self.name, "world_size", world_size, 1)
        check_int(self.name, "rank", rank, 0, world_size - 1)
        if adasum and not self.supports_adasum:
            accepted = ", ".join(n for n, c in _registry().items() if c.supports_adasum)
            raise ValueError(
                f"{self.name}: adasum=True is not supported; compressors that allow it: {accepted}"
            )
        ts = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        if not ts:
            raise ValueError(f"{self.name}: exchange needs at least one tensor")
        if sum(t.numel() for t in ts) == 0:
            return Exchange(_nothing_to_send(ts), world_size)
        return Exchange(self._rounds(key, ts, Context(world_size, rank, adasum)), world_size)

    @abstractmethod
    def _rounds(self, key: Key, tensors: list[Tensor], ctx: Context) -> Rounds:
        """Yield rounds, receive their aggregates, return the averaged tensors."""

    @abstractmethod
    def wire_bytes(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one rank sends to exchange one bucket of these shapes (steady state)."""

    def ratio(self, shapes: Sequence[Shape], world_size: int, dtype: torch.dtype = torch.float32) -> float:
        """``wire_bytes`` over a ring all-reduce of the same tensors in fp32 (nan at world size 1)."""
        ref = reference_bytes(shapes, world_size)
        return self.wire_bytes(shapes, world_size, dtype) / ref if ref else float("nan")

    # -- state ------------------------------------------------------------------------------
    def _key_state(self, key: Key, tensors: Sequence[Tensor]) -> dict[str, Any]:
        shapes = [list(t.shape) for t in tensors]
        st = self._state.get(key)
        if st is None or st.get("shapes") != shapes:
            step = 0 if st is None else int(st.get("step", 0))
            st = {"step": step, "shapes": shapes}
            self._state[key] = st
        device = tensors[0].device
        for name, value in list(st.items()):
            st[name] = _map_tensors(value, lambda t: t.to(device))
        return st

    def state_dict(self) -> dict[str, Any]:
        """Copies of every key's state: ``{"name": ..., "keys": {key: {"step": int, ...}}}``."""
        return {
            "name": self.name,
            "keys": {k: _map_tensors(v, lambda t: t.detach().clone()) for k, v in self._state.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"{self.name}: state_dict is for compressor {state.get('name')!r}")
        self._state = {k: _map_tensors(v, lambda t: t.detach().clone()) for k, v in state["keys"].items()}

    def reset(self) -> None:
        """Forget all state (error feedback, warm-start factors, momentum, step counters)."""
        self._state.clear()


def _nothing_to_send(tensors: list[Tensor]) -> Rounds:
    return [t.clone() for t in tensors]
    yield  # a generator with no rounds


def _registry() -> dict[str, type[Compressor]]:
    from lightning_dist.compression import COMPRESSORS

    return COMPRESSORS
