"""World size 1: every collective is a no-op that returns its input (or a list holding it)."""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives.backend import Backend
from lightning_dist.collectives.futures import completed_future


class SingleProcessBackend(Backend):
    """The single-process twin: same results as any backend would give at world size 1."""

    name = "single"

    @property
    @override
    def rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @override
    def all_reduce(self, tensor: Tensor, op: str, name: Optional[str] = None) -> Future:
        return completed_future(tensor)

    @override
    def broadcast(self, tensor: Tensor, src: int) -> Future:
        return completed_future(tensor)

    @override
    def all_gather(self, tensor: Tensor) -> Future:
        return completed_future([tensor.clone()])

    @override
    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        output.copy_(inputs[0])
        return completed_future(output)

    @override
    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        outputs[0].copy_(inputs[0])
        return completed_future(outputs)

    @override
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> Future:
        raise RuntimeError(
            f"send(dst={dst}): there is no peer at world size 1 (this is the single-process backend); "
            "guard point-to-point calls with `if comm.world_size > 1`, or run under a multi-rank strategy"
        )

    @override
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Future:
        raise RuntimeError(
            f"recv(src={src}): there is no peer at world size 1 (this is the single-process backend); "
            "guard point-to-point calls with `if comm.world_size > 1`, or run under a multi-rank strategy"
        )

    @override
    def barrier(self) -> None:
        return None

    @override
    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj
