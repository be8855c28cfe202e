"""Sharded's FSDP2 collectives left in flight (``sharded_comm``, ``sharded_landing``): the all-gather
returns a Work FSDP2 waits on later; a reduce-scatter (and the replica sync after it) lands at the
end of the backward where FSDP2 does not read its output at once, and at once where it does. Real
Gloo groups in threads, real autograd backwards; no processes. The trainer-level counts and the
bitwise parity with FSDP2 are in test_sharded.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from lightning_dist.collectives import Communicator, SingleProcessBackend
from lightning_dist.collectives.futures import failed_future
from lightning_dist.compression import make_compressor
from lightning_dist.testing import run_in_threads
from lightning_dist.wire.sharded_comm import PackAllGather, PackReduceScatter, ReplicaSync
from lightning_dist.wire.sharded_landing import Landing, PendingGradients

W, N = 2, 6
"""Ranks, and elements of each rank's reduce-scatter output."""


class _Group:
    """What FSDP2 hands a comm as ``group``: only its size is read."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _param_group(
    grad: bool = False, hook: bool = False, orig_dtype: Optional[torch.dtype] = None
) -> SimpleNamespace:
    """What ``Landing`` reads of FSDP2's ``FSDPParamGroup``: one parameter (with a gradient already,
    or a post-accumulate-grad hook) and the parameters' dtype."""
    param = torch.nn.Parameter(torch.zeros(N))
    if grad:
        param.grad = torch.zeros(N)
    if hook:
        param.register_post_accumulate_grad_hook(lambda p: None)
    fsdp_param = SimpleNamespace(sharded_param=param, offload_to_cpu=False)
    return SimpleNamespace(fsdp_params=[fsdp_param], _orig_dtype=orig_dtype)


def _inputs(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(W * N, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(W)]


def _in_backward(fn: Any) -> None:
    """Run ``fn()`` inside an autograd backward (from a tensor hook, as FSDP2's post-backward runs),
    and return once that backward has returned."""
    x = torch.zeros(1, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        fn()
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()


def test_all_gather_returns_a_work_that_fsdp2_waits_on_later() -> None:
    """Rank 1 posts only once rank 0 holds its Work: so rank 0's call returned before the gather
    could complete, and its ``wait()`` (FSDP2's copy-out) fills the output rank after rank."""
    posted = threading.Event()

    def body(comm: Communicator) -> tuple[bool, bool, torch.Tensor]:
        out = torch.full((W * 5,), float("nan"))
        if comm.rank == 1:
            posted.wait(timeout=5)
        work = PackAllGather(comm)(out, torch.arange(5.0) + 10 * comm.rank, _Group(W))
        in_flight = work is not None and not work.is_completed()
        posted.set()
        assert work is not None
        work.wait()
        return isinstance(work, dist.distributed_c10d.Work), in_flight, out

    expected = torch.cat([torch.arange(5.0) + 10 * r for r in range(W)])
    results = run_in_threads(W, body)
    assert results[0][:2] == (True, True)
    for is_work, _, out in results:
        assert is_work and torch.equal(out, expected)


def test_a_failed_collective_fails_its_works_wait() -> None:
    """torch's own future-to-Work wrapper returns from ``wait()`` when the future failed; the pack's
    raises the error, so a failed all-gather never hands FSDP2 uninitialised buffers."""
    work = Communicator(SingleProcessBackend()).as_work(
        failed_future(RuntimeError("peer lost")), "all_gather"
    )
    assert isinstance(work, dist.distributed_c10d.Work)
    with pytest.raises(RuntimeError, match="peer lost"):
        work.wait()


@pytest.mark.parametrize("compression", [None, "bf16", "int8"])
def test_reduce_scatter_lands_at_the_end_of_the_backward(compression: Optional[str]) -> None:
    """Inside a backward, with no gradient yet: the call returns with the output not yet written
    and one operation pending; once ``backward()`` returns the output holds what the synchronous
    call writes, bitwise, and nothing is pending."""
    inputs = _inputs()

    def body(comm: Communicator) -> tuple[int, bool, torch.Tensor, int, torch.Tensor]:
        pending = PendingGradients()
        deferring = PackReduceScatter(
            comm, compression, block_size=4, landing=Landing(pending, _param_group())
        )
        out = torch.full((N,), float("nan"))
        seen: dict[str, Any] = {}

        def post_backward() -> None:
            deferring(out, inputs[comm.rank].clone(), _Group(W), ReduceOp.AVG)
            seen.update(pending=len(pending), written=not out.isnan().any())

        _in_backward(post_backward)
        landed = out.clone()
        reference = torch.full((N,), float("nan"))
        PackReduceScatter(comm, compression, block_size=4)(
            reference, inputs[comm.rank].clone(), _Group(W), ReduceOp.AVG
        )
        return seen["pending"], seen["written"], landed, len(pending), reference

    for in_flight, written, landed, left, reference in run_in_threads(W, body):
        assert (in_flight, written, left) == (1, False, 0)
        assert torch.equal(landed, reference)
    if compression is None:
        total = torch.stack(inputs).sum(dim=0).view(W, N) / W
        assert torch.equal(run_in_threads(W, body)[1][2], total[1])


def test_int8_reduce_scatter_sums_where_it_lands_not_in_the_transports_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The int8 reduce-scatter's dequantise-sum runs on the rank's own thread when the landing runs
    (the end of the backward), never in the transport's completion thread, which stays free for
    the collectives after it; the output is what the synchronous call writes, bitwise."""
    inputs = _inputs()
    summed_on: list[int] = []
    tensor_sum = torch.Tensor.sum

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        summed_on.append(threading.get_ident())
        return tensor_sum(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", spy)

    def body(comm: Communicator) -> tuple[int, torch.Tensor, torch.Tensor]:
        pending = PendingGradients()
        deferring = PackReduceScatter(comm, "int8", block_size=4, landing=Landing(pending, _param_group()))
        out = torch.full((N,), float("nan"))
        _in_backward(lambda: deferring(out, inputs[comm.rank].clone(), _Group(W), ReduceOp.AVG))
        reference = torch.full((N,), float("nan"))
        PackReduceScatter(comm, "int8", block_size=4)(
            reference, inputs[comm.rank].clone(), _Group(W), ReduceOp.AVG
        )
        return threading.get_ident(), out, reference

    results = run_in_threads(W, body)
    rank_threads = {ident for ident, _, _ in results}
    assert summed_on and set(summed_on) <= rank_threads
    for _, out, reference in results:
        assert torch.equal(out, reference)


SYNCHRONOUS = {
    "accumulation": ({"grad": True}, torch.float32, ReduceOp.AVG, True),
    "post-accumulate-grad hook": ({"hook": True}, torch.float32, ReduceOp.AVG, True),
    "cast to the parameters' dtype": ({"orig_dtype": torch.float32}, torch.bfloat16, ReduceOp.AVG, True),
    "post-division (SUM)": ({}, torch.float32, ReduceOp.SUM, True),
    "outside a backward": ({}, torch.float32, ReduceOp.AVG, False),
}
"""Where FSDP2 reads the output right after the call (or no backward will wait): each case's
parameter group, output dtype, op, and whether the call runs inside a backward."""


@pytest.mark.parametrize("case", sorted(SYNCHRONOUS))
def test_reduce_scatter_lands_before_the_call_returns_where_fsdp2_reads_it(case: str) -> None:
    group_kwargs, dtype, op, in_backward = SYNCHRONOUS[case]
    inputs = _inputs(dtype)

    def body(comm: Communicator) -> tuple[int, torch.Tensor]:
        pending = PendingGradients()
        rs = PackReduceScatter(comm, landing=Landing(pending, _param_group(**group_kwargs)))
        out = torch.full((N,), float("nan"), dtype=dtype)
        seen: dict[str, Any] = {}

        def post_backward() -> None:
            rs(out, inputs[comm.rank].clone(), _Group(W), op)
            seen.update(pending=len(pending), out=out.clone())

        _in_backward(post_backward) if in_backward else post_backward()
        return seen["pending"] + pending.deferred, seen["out"]

    total = torch.stack(inputs).sum(dim=0).view(W, N)
    for rank, (deferred, out) in enumerate(run_in_threads(W, body)):
        assert deferred == 0
        assert torch.equal(out, total[rank] / W if op == ReduceOp.AVG else total[rank])


def test_deferred_replica_syncs_chain_and_equal_the_synchronous_ones() -> None:
    """HSDP: two parameter groups' shard gradients, their reduce-scatters left in flight; each
    replica sync (PowerSGD: two rounds, the second posted from a completion callback) waits for its
    reduce-scatter, runs behind the one before, and lands at the end of the backward with what the
    synchronous sync gives, bitwise."""
    shards = [(0, torch.Size([4, 3])), (12, torch.Size([2, 3]))]
    grads = [
        [torch.randn(18, generator=torch.Generator().manual_seed(10 * r + k)) for k in range(2)]
        for r in range(W)
    ]

    def sync(comm: Communicator, key: str, **kwargs: Any) -> ReplicaSync:
        compressor = make_compressor("powersgd", rank=1, min_compression_rate=0)
        return ReplicaSync(comm, compressor, key, shards, **kwargs)

    def body(comm: Communicator) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        pending = PendingGradients()
        landed: list[bool] = []
        hooks = []
        for k in range(2):
            reduce_scatter = SimpleNamespace(deferred=lambda k=k: landed.append(k))  # its landing
            hooks.append(sync(comm, f"fsdp{k}", reduce_scatter=reduce_scatter, pending=pending))
        flats = [g.clone() for g in grads[comm.rank]]
        counts: list[int] = []

        def post_backward() -> None:
            for hook, flat in zip(hooks, flats, strict=True):
                hook(flat)
                counts.append(len(pending))

        _in_backward(post_backward)
        assert landed == [0, 1], "each sync waited for its reduce-scatter first"
        references = [g.clone() for g in grads[comm.rank]]
        for k, flat in enumerate(references):
            sync(comm, f"fsdp{k}")(flat)
        return counts + [len(pending)], flats, references

    for counts, flats, references in run_in_threads(W, body):
        assert counts == [1, 2, 0]
        for got, expected in zip(flats, references, strict=True):
            assert torch.equal(got, expected)
