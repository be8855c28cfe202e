"""Every collective at 2 and 3 ranks over real Gloo groups, against a single-process reference,
with the byte counters checked against the documented wire model."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from lightning_dist import collectives
from lightning_dist.collectives import Communicator, SingleProcessBackend
from lightning_dist.collectives.futures import chain
from lightning_dist.testing import run_in_threads

WORLD_SIZES = [2, 3]


def rank_tensor(
    rank: int, shape: tuple[int, ...] = (5, 3), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def reduce_reference(per_rank: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(per_rank)
    if op in ("min", "max"):
        return stacked.amin(0) if op == "min" else stacked.amax(0)
    return stacked.sum(0) if op == "sum" else stacked.mean(0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_all_reduce_matches_reference(world_size: int, op: str) -> None:
    expected = reduce_reference([rank_tensor(r) for r in range(world_size)], op)

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
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_large_gloo_all_gather_goes_out_in_pieces(
    world_size: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above ``gloo_piece_bytes`` the payload is split (here 7 pieces, the last one short) and
    every rank still gets every rank's tensor exactly, with the bytes of one all-gather counted."""
    from lightning_dist.collectives import torch_backend

    monkeypatch.setattr(torch_backend.TorchBackend, "gloo_piece_bytes", 24)
    splits: list[int] = []
    real_bounds = torch_backend.piece_bounds

    def counting_bounds(numel: int, element_size: int, piece_bytes: int) -> list[tuple[int, int]]:
        bounds = real_bounds(numel, element_size, piece_bytes)
        splits.append(len(bounds))
        return bounds

    monkeypatch.setattr(torch_backend, "piece_bounds", counting_bounds)
    shape = (5, 8) if dtype == torch.float32 else (12, 14)  # 160 B / 168 B: 7 pieces of 24 B at most

    def body(comm: Communicator) -> tuple[list[torch.Tensor], dict[str, float]]:
        t = (rank_tensor(comm.rank, shape) * 50).to(dtype)
        return comm.all_gather(t, same_shape=True), comm.stats.snapshot()

    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    for gathered, snap in run_in_threads(world_size, body):
        for r, g in enumerate(gathered):
            assert g.shape == shape and g.dtype == dtype
            assert torch.equal(g, (rank_tensor(r, shape) * 50).to(dtype))
        assert snap["all_gather.calls"] == 1
        assert snap["all_gather.bytes_sent"] == (world_size - 1) * nbytes
    assert splits == [7] * world_size


@pytest.mark.parametrize("piece_bytes", [1 << 20, 24])
def test_gloo_all_gather_into_one_piece_goes_straight_into_the_output(
    piece_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP2's all-gather (``all_gather_into``) of at most one piece is one ``_allgather_base`` into
    the output, not the list all-gather plus copies; above a piece it goes out in pieces. Either
    way every rank gets every rank's tensor, rank after rank, with the bytes of one all-gather."""
    from lightning_dist.collectives import torch_backend

    monkeypatch.setattr(torch_backend.TorchBackend, "gloo_piece_bytes", piece_bytes)
    listed: list[int] = []
    real = torch_backend.TorchBackend.all_gather

    def counting(self: torch_backend.TorchBackend, tensor: torch.Tensor) -> object:
        listed.append(tensor.numel())
        return real(self, tensor)

    monkeypatch.setattr(torch_backend.TorchBackend, "all_gather", counting)
    w = 3

    def body(comm: Communicator) -> tuple[torch.Tensor, dict[str, float]]:
        out = torch.empty(w * 40)
        return comm.all_gather_into(out, rank_tensor(comm.rank, (40,))), comm.stats.snapshot()

    expected = torch.cat([rank_tensor(r, (40,)) for r in range(w)])
    for out, snap in run_in_threads(w, body):
        assert torch.equal(out, expected)
        assert snap["all_gather.calls"] == 1 and snap["all_gather.bytes_sent"] == (w - 1) * 160
    assert listed == ([] if piece_bytes > 160 else [40] * w)


def test_piece_bounds_cover_the_tensor_in_order() -> None:
    from lightning_dist.collectives.torch_backend import piece_bounds

    assert piece_bounds(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert piece_bounds(4, 8, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)], "at least one element per piece"
    assert piece_bounds(0, 4, 12) == []


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
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_reduce_scatter(world_size: int, op: str) -> None:
    def body(comm: Communicator) -> tuple[torch.Tensor, dict[str, float]]:
        return comm.reduce_scatter(rank_tensor(comm.rank, (world_size * 2, 3)), op), comm.stats.snapshot()

    full = reduce_reference([rank_tensor(r, (world_size * 2, 3)) for r in range(world_size)], op)
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


def test_reduce_scatter_sums_in_rank_order() -> None:
    def body(comm: Communicator) -> torch.Tensor:
        return comm.reduce_scatter([rank_tensor(comm.rank, (6,)) * 10**j for j in range(3)], "sum")

    for rank, out in enumerate(run_in_threads(3, body)):
        parts = [rank_tensor(r, (6,)) * 10**rank for r in range(3)]
        assert torch.equal(out, parts[0] + parts[1] + parts[2])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_known_shapes_can_start_from_a_callback(world_size: int) -> None:
    """all_gather of equal shapes and all_to_all with the row counts given (unequal ones too) never
    block and exchange no shapes, so a callback may start them."""

    def body(comm: Communicator) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
        r = comm.rank
        first = comm.all_reduce_async(torch.ones(2))
        gathered = chain(first, lambda _: comm.all_gather_async(torch.full((2, 2), float(r))))
        rows = [src + 1 for src in range(world_size)]  # rank r sends r + 1 rows to everyone
        moved = chain(
            gathered,
            lambda _: comm.all_to_all_async([torch.full((r + 1,), float(r))] * world_size, rows),
        )
        return gathered.wait(), moved.wait(), comm.stats.snapshot()

    for gathered, moved, snap in run_in_threads(world_size, body):
        for src in range(world_size):
            assert torch.equal(gathered[src], torch.full((2, 2), float(src)))
            assert torch.equal(moved[src], torch.full((src + 1,), float(src)))
        assert snap["all_gather.calls"] == 1 and snap["all_to_all.calls"] == 1, "no shape exchange"
        assert snap["all_gather.seconds"] > 0 and snap["all_to_all.seconds"] > 0


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shape_exchanges_block_and_keep_call_order(world_size: int) -> None:
    """all_gather of unequal shapes and all_to_all without row counts exchange shapes first, on the
    calling thread, between asynchronous calls posted before and after them (ranks at different
    paces): every rank posts them in call order."""

    def body(comm: Communicator) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor]:
        r = comm.rank
        before = comm.all_reduce_async(torch.full((4,), float(r)))
        gathered = comm.all_gather(torch.full((r + 1, 3), float(r)))
        if r == 0:
            time.sleep(0.2)
        moved = comm.all_to_all([torch.full((r + j + 1,), float(r)) for j in range(world_size)])
        sent = comm.broadcast_async(torch.full((2,), float(r)), src=world_size - 1)
        comm.barrier()
        return gathered, before.wait(), moved, sent.wait()

    total = float(sum(range(world_size)))
    for rank, (gathered, reduced, moved, sent) in enumerate(run_in_threads(world_size, body)):
        assert all(torch.equal(g, torch.full((j + 1, 3), float(j))) for j, g in enumerate(gathered))
        assert torch.equal(reduced, torch.full((4,), total))
        assert all(torch.equal(m, torch.full((j + rank + 1,), float(j))) for j, m in enumerate(moved))
        assert torch.equal(sent, torch.full((2,), float(world_size - 1)))


def test_all_to_all_async_needs_a_row_count_per_rank() -> None:
    comm = Communicator(SingleProcessBackend())
    with pytest.raises(ValueError, match=r"output_rows needs 1 row counts \(one per rank\), got 2"):
        comm.all_to_all_async([torch.ones(1)], [1, 1])


def test_unequal_trailing_dimensions_fail_on_every_rank() -> None:
    def body(comm: Communicator) -> str:
        with pytest.raises(ValueError, match="may differ only in their first dimension"):
            comm.all_gather(torch.zeros(2, comm.rank + 1))
        comm.all_reduce(torch.ones(1))  # the communicator is still usable
        return "ok"

    assert run_in_threads(2, body) == ["ok", "ok"]


def test_run_in_threads_fails_fast_when_a_rank_raises() -> None:
    def body(comm: Communicator) -> None:
        if comm.rank == 1:
            raise KeyError("boom")
        comm.all_reduce(torch.ones(2))  # blocks on rank 1 until its group closes

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed: KeyError"):
        run_in_threads(2, body, timeout=60)
    assert time.monotonic() - start < 30


def test_run_in_threads_has_one_deadline() -> None:
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 1.0s"):
        run_in_threads(2, lambda comm: release.wait(30), timeout=1.0)
    assert time.monotonic() - start < 2.5
    release.set()  # let the ranks end, so that no process group outlives the test
    for t in threading.enumerate():
        if t.name in ("rank0", "rank1"):
            t.join(10)


def test_all_to_all_with_empty_chunks() -> None:
    def body(comm: Communicator) -> list[torch.Tensor]:
        return comm.all_to_all([torch.full((comm.rank * j, 2), float(comm.rank)) for j in range(3)])

    for rank, outs in enumerate(run_in_threads(3, body)):
        assert [tuple(o.shape) for o in outs] == [(src * rank, 2) for src in range(3)]


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
    assert not dist.is_initialized()
    assert isinstance(collectives.world().backend, SingleProcessBackend)
    collectives.world().stats.reset()
    t = torch.ones(3)
    assert torch.equal(collectives.all_reduce(t, "sum"), torch.ones(3))
    assert collectives.world().stats.calls == 0 and collectives.world().stats.bytes_sent == 0


def test_unknown_op_names_accepted_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"op='median' is not supported; accepted: 'sum', 'avg', 'min', 'max', 'adasum' \(also 'add' for "
        r"'sum'; 'mean' or 'average' for 'avg'; torch.distributed.ReduceOp.SUM/AVG/MIN/MAX\)$",
    ):
        collectives.all_reduce(torch.ones(2), "median")
    for spelling in ("mean", "average", "AVG", torch.distributed.ReduceOp.AVG):
        assert torch.equal(collectives.all_reduce(torch.ones(2), spelling), torch.ones(2))
