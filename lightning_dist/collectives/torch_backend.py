"""Transport over a torch.distributed process group (Gloo on CPU tensors, NCCL on CUDA tensors).

Calls go to the ``ProcessGroup`` object's methods, so a group made without ``init_process_group``
(one per thread in tests) works the same as the default world group.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_dist.collectives.backend import Backend

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _first(fut: Future) -> Any:
    value = fut.value()
    return value[0] if isinstance(value, list) else value


class TorchBackend(Backend):
    """Collectives on one ``torch.distributed`` process group."""

    name = "torch"

    def __init__(self, group: Optional[Any] = None) -> None:
        """``group``: a ``ProcessGroup`` (default: the world group) or a backend object such as
        ``ProcessGroupGloo`` made directly from a store."""
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError("TorchBackend needs an initialised process group or an explicit `group`")
            group = dist.group.WORLD
        assert group is not None
        self.group: Any = group
        self._device_type = self._detect_device_type()

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def world_size(self) -> int:
        return self.group.size()

    @property
    def device_type(self) -> str:
        """``cuda`` when the group runs NCCL, else ``cpu``: where control tensors must live."""
        return self._device_type

    def _detect_device_type(self) -> str:
        name: str
        try:
            name = str(dist.get_backend(self.group))
        except (RuntimeError, ValueError):
            name = str(self.group.name()) if hasattr(self.group, "name") else "gloo"
        return "cuda" if "nccl" in name.lower() else "cpu"

    def _to_device(self, tensor: Tensor) -> Tensor:
        if self.device_type == "cuda":
            return tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor

    def all_reduce(self, tensor: Tensor, op: str) -> Future:
        opts = dist.AllreduceOptions()
        if op == "avg":
            # Divide first, then sum: the order torch's DDP reducer uses, so results match it bitwise.
            tensor.div_(self.world_size)
            opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        else:
            opts.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
        return self.group.allreduce([tensor], opts).get_future().then(_first)

    def broadcast(self, tensor: Tensor, src: int) -> Future:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.group.broadcast([tensor], opts).get_future().then(_first)

    def all_gather(self, tensor: Tensor) -> Future:
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]]
        work = self.group.allgather(outputs, [tensor])
        return work.get_future().then(lambda _: outputs[0])

    def reduce_scatter(self, output: Tensor, inputs: list[Tensor], op: str) -> Future:
        opts = dist.ReduceScatterOptions()
        if op == "avg":
            inputs = [t / self.world_size for t in inputs]
            opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        else:
            opts.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
        work = self.group.reduce_scatter([output], [inputs], opts)
        return _work_future(work, output)

    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Future:
        # alltoall_base with split sizes handles unequal first dimensions on Gloo and NCCL alike.
        send = torch.cat([t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1) for t in inputs])
        recv_rows = [t.shape[0] if t.dim() else 1 for t in outputs]
        recv = torch.empty((sum(recv_rows), *send.shape[1:]), dtype=send.dtype, device=send.device)
        send_rows = [t.shape[0] if t.dim() else 1 for t in inputs]
        work = self.group.alltoall_base(recv, send, recv_rows, send_rows, dist.AllToAllOptions())

        def _split(_: Any) -> list[Tensor]:
            for out, part in zip(outputs, recv.split(recv_rows)):
                out.copy_(part.reshape(out.shape))
            return outputs

        return _work_future(work, None).then(_split)

    def send(self, tensor: Tensor, dst: int) -> Future:
        work = self.group.send([tensor], dst, 0)
        return _work_future(work, tensor)

    def recv(self, tensor: Tensor, src: int) -> Future:
        work = self.group.recv([tensor], src, 0)
        return _work_future(work, tensor)

    def barrier(self) -> None:
        if self.device_type == "cuda":
            # A tiny all-reduce instead of ProcessGroup.barrier, which guesses a device for NCCL.
            self.all_reduce(self._to_device(torch.zeros(1)), "sum").wait()
        else:
            self.group.barrier().wait()


def _work_future(work: Any, value: Any) -> Future:
    """A future for ``work``; Gloo gives some ops (reduce_scatter, send/recv) no future of their
    own, so a helper thread waits on those and completes one."""
    try:
        return work.get_future().then(lambda _: value)
    except RuntimeError:
        fut: Future = Future()

        def _wait() -> None:
            try:
                work.wait()
                fut.set_result(value)
            except Exception as exc:  # noqa: BLE001  (delivered through the future)
                fut.set_exception(exc)

        threading.Thread(target=_wait, daemon=True).start()
        return fut
