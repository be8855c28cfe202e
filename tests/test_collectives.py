"""Every collective at 2 and 3 ranks over real Gloo groups, against a single-process reference,
with the byte counters checked against the documented wire model."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import collectives
from lightning_dist.collectives import Communicator, SingleProcessBackend
from lightning_dist.testing import run_in_threads

WORLD_SIZES = [2, 3]


def rank_tensor(
    rank: int, shape: tuple[int, ...] = (5, 3), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_all_reduce_matches_reference(world_size: int, op: str) -> None:
    inputs = [rank_tensor(r) for r in range(world_size)]
    stacked = torch.stack(inputs)
    expected = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "min": stacked.min(0).values,
        "max": stacked.max(0).values,
    }[op]

    def body(comm: Communicator) -> tuple[torch.Tensor, dict[str, float]]:
        t = rank_tensor(comm.rank)
        out = comm.all_reduce(t, op)
        assert out is t, "all_reduce works in place"
        return t, comm.stats.snapshot()

    results = run_in_threads(world_size, body)
    nbytes = 5 * 3 * 4
    ring = 2 * (world_size - 1) * nbytes // world_size
    for out, snap in results:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert snap["all_reduce.calls"] == 1
        assert snap["all_reduce.bytes_sent"] == ring
        assert snap["all_reduce.bytes_received"] == ring


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_list_is_fused_and_unflattened(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[list[torch.Tensor], dict[str, float]]:
        ts = [rank_tensor(comm.rank, (4,)), rank_tensor(comm.rank + 10, (2, 3))]
        comm.all_reduce(ts, "sum")
        return ts, comm.stats.snapshot()

    results = run_in_threads(world_size, body)
    exp0 = sum(rank_tensor(r, (4,)) for r in range(world_size))
    exp1 = sum(rank_tensor(r + 10, (2, 3)) for r in range(world_size))
    for ts, snap in results:
        torch.testing.assert_close(ts[0], exp0)
        torch.testing.assert_close(ts[1], exp1)
        assert snap["all_reduce.calls"] == 1, "a list is one fused call"
        assert snap["all_reduce.bytes_sent"] == 2 * (world_size - 1) * (10 * 4) // world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_async_returns_future(world_size: int) -> None:
    def body(comm: Communicator) -> torch.Tensor:
        fut = comm.all_reduce_async(torch.full((3,), float(comm.rank + 1)), "sum")
        return fut.wait()

    expected = torch.full((3,), float(sum(range(1, world_size + 1))))
    for out in run_in_threads(world_size, body):
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_tensor_and_object(world_size: int, src: int) -> None:
    def body(comm: Communicator) -> tuple[torch.Tensor, object, dict[str, float]]:
        t = rank_tensor(comm.rank, (7,))
        comm.broadcast(t, src)
        obj = comm.broadcast_object({"rank": comm.rank, "payload": [1, 2, 3]}, src)
        return t, obj, comm.stats.snapshot()

    results = run_in_threads(world_size, body)
    for rank, (t, obj, snap) in enumerate(results):
        torch.testing.assert_close(t, rank_tensor(src, (7,)))
        assert obj == {"rank": src, "payload": [1, 2, 3]}
        if rank == src:
            assert snap["broadcast.bytes_sent"] == (world_size - 1) * 28
            assert snap["broadcast.bytes_received"] == 0
        else:
            assert snap["broadcast.bytes_sent"] == 0
            assert snap["broadcast.bytes_received"] == 28


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_equal_shapes(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[list[torch.Tensor], dict[str, float]]:
        return comm.all_gather(rank_tensor(comm.rank, (2, 3)), same_shape=True), comm.stats.snapshot()

    for gathered, snap in run_in_threads(world_size, body):
        assert len(gathered) == world_size
        for r, g in enumerate(gathered):
            torch.testing.assert_close(g, rank_tensor(r, (2, 3)))
        assert snap["all_gather.bytes_sent"] == (world_size - 1) * 24
        assert snap["all_gather.bytes_received"] == (world_size - 1) * 24


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_unequal_first_dimension(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[list[torch.Tensor], dict[str, float]]:
        t = rank_tensor(comm.rank, (comm.rank + 1, 4))
        return comm.all_gather(t), comm.stats.snapshot()

    for gathered, snap in run_in_threads(world_size, body):
        for r, g in enumerate(gathered):
            torch.testing.assert_close(g, rank_tensor(r, (r + 1, 4)))
        # shape exchange: 2 int64 dims; payload padded to the longest (world_size rows x 4 floats)
        shape_bytes = (world_size - 1) * 16
        payload = (world_size - 1) * world_size * 4 * 4
        assert snap["all_gather.calls"] == 2
        assert snap["all_gather.bytes_sent"] == shape_bytes + payload
        assert snap["all_gather.bytes_received"] == shape_bytes + payload


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter(world_size: int, op: str) -> None:
    def body(comm: Communicator) -> tuple[torch.Tensor, dict[str, float]]:
        return comm.reduce_scatter(rank_tensor(comm.rank, (world_size * 2, 3)), op), comm.stats.snapshot()

    stacked = torch.stack([rank_tensor(r, (world_size * 2, 3)) for r in range(world_size)])
    full = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0).values}[op]
    for rank, (out, snap) in enumerate(run_in_threads(world_size, body)):
        torch.testing.assert_close(out, full.chunk(world_size)[rank], rtol=1e-6, atol=1e-6)
        moved = (world_size - 1) * (world_size * 2 * 3 * 4) // world_size
        assert snap["reduce_scatter.bytes_sent"] == moved
        assert snap["reduce_scatter.bytes_received"] == moved


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_uneven(world_size: int) -> None:
    def chunk(src: int, dst: int) -> torch.Tensor:
        return torch.full((src + dst + 1, 2), float(10 * src + dst))

    def body(comm: Communicator) -> tuple[list[torch.Tensor], dict[str, float]]:
        inputs = [chunk(comm.rank, j) for j in range(world_size)]
        return comm.all_to_all(inputs), comm.stats.snapshot()

    for rank, (outs, snap) in enumerate(run_in_threads(world_size, body)):
        for src, got in enumerate(outs):
            torch.testing.assert_close(got, chunk(src, rank))
        sent = sum((rank + j + 1) * 8 for j in range(world_size) if j != rank)
        received = sum((j + rank + 1) * 8 for j in range(world_size) if j != rank)
        lengths = (world_size - 1) * 8
        assert snap["all_to_all.bytes_sent"] == sent + lengths
        assert snap["all_to_all.bytes_received"] == received + lengths


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier_and_reset(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[dict[str, float], dict[str, float]]:
        comm.all_reduce(torch.ones(4))
        comm.barrier()
        before = comm.stats.snapshot()
        comm.stats.reset()
        return before, comm.stats.snapshot()

    for before, after in run_in_threads(world_size, body):
        assert before["barrier.calls"] == 1
        assert before["calls"] == 2
        assert before["seconds"] > 0
        assert after["calls"] == 0 and after["bytes_sent"] == 0


def test_single_process_twin_is_identity_with_zero_bytes() -> None:
    comm = Communicator(SingleProcessBackend(), stats=collectives.CommStats())
    t = torch.arange(6.0)
    assert torch.equal(comm.all_reduce(t.clone(), "avg"), t)
    assert torch.equal(comm.broadcast(t.clone(), 0), t)
    assert torch.equal(comm.all_gather(t)[0], t)
    assert torch.equal(comm.reduce_scatter(t), t)
    assert torch.equal(comm.all_to_all([t])[0], t)
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    comm.barrier()
    assert comm.stats.bytes_sent == 0 and comm.stats.bytes_received == 0


def test_module_level_functions_default_to_single_process() -> None:
    collectives.reset_stats()
    t = torch.ones(3)
    assert torch.equal(collectives.all_reduce(t, "sum"), torch.ones(3))
    assert collectives.stats().bytes_sent == 0


def test_unknown_op_names_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"op='median'.*sum, avg, min, max, adasum"):
        collectives.all_reduce(torch.ones(2), "median")
