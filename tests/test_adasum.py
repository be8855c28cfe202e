"""Adasum math and the collective: the pairwise rule, the reference tree, and the
vector-halving/distance-doubling exchange at 2-5 ranks over real Gloo groups (threads)."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.futures import Future
from typing_extensions import override

from lightning_dist.collectives import Backend, Communicator, SingleProcessBackend, TorchBackend, trace
from lightning_dist.collectives import adasum as adasum_mod
from lightning_dist.collectives import communicator as communicator_mod
from lightning_dist.collectives.adasum import adasum_all_reduce, adasum_pair, adasum_reference
from lightning_dist.testing import run_in_threads

SHAPES = [(5, 3), (7,), (1,), (4, 4, 2), (0,), (33,)]


def rank_tensors(rank: int, dtype: torch.dtype = torch.float32, shapes: list = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2000 + rank)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def formula(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().flatten(), b.double().flatten()
    dot = a @ b
    return a * (1 - dot / (2 * (a @ a))) + b * (1 - dot / (2 * (b @ b)))


def adasum_threads(world_size: int, make: Any) -> list[tuple[list[torch.Tensor], dict[str, float]]]:
    """Each rank reduces ``make(rank)`` with op='adasum'; returns (outputs, stats) per rank."""

    def body(comm: Communicator) -> tuple[list[torch.Tensor], dict[str, float]]:
        ts = make(comm.rank)
        out = comm.all_reduce(ts, op="adasum")
        assert all(o is t for o, t in zip(out, ts, strict=True)), "adasum works in place"
        return ts, comm.stats.snapshot()

    return run_in_threads(world_size, body)


def assert_ranks_identical(results: list[tuple[list[torch.Tensor], dict[str, float]]]) -> None:
    for outs, _ in results[1:]:
        for x, y in zip(outs, results[0][0], strict=True):
            assert torch.equal(x, y), "every rank must end with bitwise the same result"


# -- the pairwise rule and the reference ------------------------------------------------------------
def test_orthogonal_inputs_give_their_sum() -> None:
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    torch.testing.assert_close(adasum_pair(a, b).float(), a + b)
    torch.testing.assert_close(adasum_reference([a, b]), a + b)


def test_identical_inputs_give_the_input() -> None:
    a = torch.randn(10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(adasum_pair(a, a).float(), a)
    for world_size in (2, 3, 4, 5):
        torch.testing.assert_close(adasum_reference([a] * world_size), a)


def test_opposite_inputs_cancel_and_zero_norm_guard() -> None:
    a = torch.tensor([1.0, -2.0, 3.0])
    torch.testing.assert_close(adasum_pair(a, -a).float(), torch.zeros(3))
    zero = torch.zeros(3)
    torch.testing.assert_close(adasum_pair(zero, a).float(), a)
    torch.testing.assert_close(adasum_pair(a, zero).float(), a)
    torch.testing.assert_close(adasum_pair(zero, zero).float(), zero)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-100, 100).filter(lambda v: v == 0 or abs(v) > 1e-6), min_size=1, max_size=12),
    st.lists(st.floats(-100, 100).filter(lambda v: v == 0 or abs(v) > 1e-6), min_size=1, max_size=12),
    st.floats(0.01, 100),
)
def test_pair_matches_formula_symmetric_and_scale_equivariant(xs: list, ys: list, k: float) -> None:
    n = min(len(xs), len(ys))
    a, b = torch.tensor(xs[:n], dtype=torch.float64), torch.tensor(ys[:n], dtype=torch.float64)
    out = adasum_pair(a, b)
    torch.testing.assert_close(adasum_pair(b, a), out)
    torch.testing.assert_close(adasum_pair(k * a, k * b), k * out, rtol=1e-9, atol=1e-9)
    if float(a @ a) > 0 and float(b @ b) > 0:
        torch.testing.assert_close(out, formula(a, b))


def test_reference_tree_order() -> None:
    """Power of two: pairs at distance 1, then 2; beyond it, rank r >= P folds into r - P first."""
    xs = rank_tensors(0, shapes=[(6,)]) + rank_tensors(1, shapes=[(6,)]) + rank_tensors(2, shapes=[(6,)])
    x3 = rank_tensors(3, shapes=[(6,)])[0]
    four = formula(formula(xs[0], xs[1]), formula(xs[2], x3))
    torch.testing.assert_close(
        adasum_reference([xs[0], xs[1], xs[2], x3]).double(), four, rtol=1e-6, atol=1e-6
    )
    three = formula(formula(xs[0], xs[2]), xs[1])
    torch.testing.assert_close(adasum_reference(xs).double(), three, rtol=1e-6, atol=1e-6)


def test_reference_rejects_empty_and_ragged_inputs() -> None:
    with pytest.raises(ValueError, match="per_rank_tensors"):
        adasum_reference([])
    with pytest.raises(ValueError, match="same number"):
        adasum_reference([[torch.ones(2)], [torch.ones(2), torch.ones(2)]])


# -- the collective ---------------------------------------------------------------------------------
def test_two_ranks_match_the_formula() -> None:
    results = adasum_threads(2, rank_tensors)
    assert_ranks_identical(results)
    for out, a, b in zip(results[0][0], rank_tensors(0), rank_tensors(1), strict=True):
        if out.numel():
            torch.testing.assert_close(out.double(), formula(a, b).reshape(out.shape), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_orthogonal_and_identical_at_many_ranks(world_size: int) -> None:
    eye = torch.eye(world_size)
    results = adasum_threads(world_size, lambda r: [eye[r].clone(), torch.arange(4.0) + 1])
    for outs, _ in results:
        torch.testing.assert_close(outs[0], torch.ones(world_size))
        torch.testing.assert_close(outs[1], torch.arange(4.0) + 1)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 16])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_collective_equals_reference(
    world_size: int, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adasum_mod, "CHUNK_BYTES", chunk_bytes)
    results = adasum_threads(world_size, rank_tensors)
    assert_ranks_identical(results)
    expected = adasum_reference([rank_tensors(r) for r in range(world_size)])
    for out, ref in zip(results[0][0], expected, strict=True):
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_many_small_tensors_in_one_chunk() -> None:
    shapes = [(i % 5 + 1,) for i in range(40)]
    results = adasum_threads(4, lambda r: rank_tensors(r, shapes=shapes))
    expected = adasum_reference([rank_tensors(r, shapes=shapes) for r in range(4)])
    for out, ref in zip(results[0][0], expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_other_dtypes(world_size: int, dtype: torch.dtype) -> None:
    results = adasum_threads(world_size, lambda r: rank_tensors(r, dtype))
    assert_ranks_identical(results)
    expected = adasum_reference([rank_tensors(r, dtype) for r in range(world_size)])
    tol = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    for out, ref in zip(results[0][0], expected, strict=True):
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol)


def test_mixed_dtypes_in_one_call() -> None:
    def make(r: int) -> list[torch.Tensor]:
        a, b, c = rank_tensors(r, shapes=[(8,), (3, 3), (5,)])
        return [a, b.half(), c.double()]

    results = adasum_threads(3, make)
    expected = adasum_reference([make(r) for r in range(3)])
    for out, ref in zip(results[0][0], expected, strict=True):
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, rtol=3e-3, atol=3e-3)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero_tensors(world_size: int) -> None:
    def make(r: int) -> list[torch.Tensor]:
        own = rank_tensors(r, shapes=[(6,)])[0]
        return [torch.zeros(6), own if r == 0 else torch.zeros(6)]

    results = adasum_threads(world_size, make)
    for outs, _ in results:
        torch.testing.assert_close(outs[0], torch.zeros(6))
        torch.testing.assert_close(outs[1], rank_tensors(0, shapes=[(6,)])[0])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_single_tensor_in_place_and_non_contiguous(world_size: int) -> None:
    def body(comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        a = rank_tensors(comm.rank, shapes=[(4, 6)])[0]
        out = comm.all_reduce(a, op="adasum")
        assert out is a
        b = rank_tensors(comm.rank, shapes=[(6, 4)])[0].t()
        comm.all_reduce([b], op="adasum")
        return a, b

    results = run_in_threads(world_size, body)
    ref_a = adasum_reference([rank_tensors(r, shapes=[(4, 6)])[0] for r in range(world_size)])
    ref_b = adasum_reference([rank_tensors(r, shapes=[(6, 4)])[0].t() for r in range(world_size)])
    for a, b in results:
        torch.testing.assert_close(a, ref_a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, ref_b, rtol=1e-5, atol=1e-6)


def test_async_adasum_returns_while_the_exchange_runs() -> None:
    """The async form hands back a pending future at once (a DDP bucket's Adasum overlaps the rest of
    backward) and completes with the reference result once the late rank joins."""
    late_s = 0.5

    def body(comm: Communicator) -> tuple[list[torch.Tensor], float, bool]:
        ts = rank_tensors(comm.rank)
        if comm.rank == 1:
            time.sleep(late_s)
        start = time.perf_counter()
        fut = comm.all_reduce_async(ts, op="adasum")
        returned_after = time.perf_counter() - start
        pending = not fut.done()
        assert fut.wait() is not None
        return ts, returned_after, pending

    results = run_in_threads(2, body)
    outs, returned_after, pending = results[0]
    assert pending and returned_after < late_s / 2, f"rank 0 waited {returned_after:.3f}s for rank 1"
    assert torch.equal(
        torch.cat([o.flatten() for o in outs]), torch.cat([o.flatten() for o in results[1][0]])
    )
    for out, ref in zip(outs, adasum_reference([rank_tensors(r) for r in range(2)]), strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_calls_made_during_an_adasum_are_posted_after_it_in_order(
    world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adasum, an all-reduce, a second Adasum and a broadcast posted back to back (ranks at different
    paces) all complete with their own reference results."""
    monkeypatch.setattr(adasum_mod, "CHUNK_BYTES", 16)
    shapes_b = [(3, 5), (11,)]

    def body(comm: Communicator) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor], torch.Tensor]:
        first, second = rank_tensors(comm.rank), rank_tensors(comm.rank + 10, shapes=shapes_b)
        summed = torch.full((7,), float(comm.rank + 1))
        sent = torch.arange(5.0) if comm.rank == 0 else torch.zeros(5)
        time.sleep(0.05 * comm.rank)
        futs = [
            comm.all_reduce_async(first, op="adasum"),
            comm.all_reduce_async(summed, op="sum"),
            comm.all_reduce_async(second, op="adasum"),
            comm.broadcast_async(sent, src=0),
        ]
        for fut in futs:
            fut.wait()
        return first, summed, second, sent

    results = run_in_threads(world_size, body)
    ref_first = adasum_reference([rank_tensors(r) for r in range(world_size)])
    ref_second = adasum_reference([rank_tensors(r + 10, shapes=shapes_b) for r in range(world_size)])
    total = float(sum(range(1, world_size + 1)))
    for first, summed, second, sent in results:
        for out, ref in zip([*first, *second], [*ref_first, *ref_second], strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(summed, torch.full((7,), total))
        torch.testing.assert_close(sent, torch.arange(5.0))


def traced_adasum(
    monkeypatch: pytest.MonkeyPatch, hold_first: bool
) -> tuple[list[tuple[int, str, int, int]], dict[int, bool]]:
    """Records (rank, "start"/"end", call, tag) of every Adasum exchange; call ``i`` is the one whose
    first tensor has ``i + 2`` rows. With ``hold_first`` call 0 waits (up to 5 s) for call 1 to start
    and notes per rank whether it did."""
    real = communicator_mod.adasum_all_reduce
    log: list[tuple[int, str, int, int]] = []
    lock = threading.Lock()
    second_started: dict[int, threading.Event] = {}
    overlapped: dict[int, bool] = {}

    def traced(backend: Backend, tensors: list[torch.Tensor], *tag_arg: int) -> Any:
        call, tag = tensors[0].shape[0] - 2, (tag_arg or (adasum_mod.ADASUM_TAG,))[0]
        with lock:
            log.append((backend.rank, "start", call, tag))
            started = second_started.setdefault(backend.rank, threading.Event())
        if call == 1:
            started.set()
        if call == 0 and hold_first:
            overlapped[backend.rank] = started.wait(5.0)
        out = real(backend, tensors, *tag_arg)
        with lock:
            log.append((backend.rank, "end", call, tag))
        return out

    monkeypatch.setattr(communicator_mod, "adasum_all_reduce", traced)
    return log, overlapped


def three_adasums_and_a_sum(comm: Communicator) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Three Adasum calls back to back (call i: a first tensor of i + 2 rows), then an all-reduce."""
    calls = [rank_tensors(comm.rank + 10 * i, shapes=[(i + 2, 3), (5,)]) for i in range(3)]
    summed = torch.full((4,), float(comm.rank + 1))
    futs = [comm.all_reduce_async(ts, op="adasum") for ts in calls]
    futs.append(comm.all_reduce_async(summed, op="sum"))
    for fut in futs:
        fut.wait()
    return calls, summed


def check_three_adasums(world_size: int, results: list[Any]) -> None:
    for i in range(3):
        ref = adasum_reference(
            [rank_tensors(r + 10 * i, shapes=[(i + 2, 3), (5,)]) for r in range(world_size)]
        )
        for calls, _ in results:
            for out, expected in zip(calls[i], ref, strict=True):
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for _, summed in results:
        torch.testing.assert_close(summed, torch.full((4,), float(sum(range(1, world_size + 1)))))


@pytest.mark.parametrize("world_size", [2, 3])
def test_consecutive_adasums_overlap_where_tags_are_independent(
    world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Gloo the next Adasum starts while the previous one still runs (one lane and tag each), so
    one DDP bucket's exchange fills the link while the previous one waits on its dot products; a lane
    runs its calls in order, and the all-reduce posted after them still waits for all three."""
    monkeypatch.setattr(adasum_mod, "CHUNK_BYTES", 16)
    log, overlapped = traced_adasum(monkeypatch, hold_first=True)
    results = run_in_threads(world_size, three_adasums_and_a_sum)
    assert overlapped == dict.fromkeys(range(world_size), True), "call 1 never started while call 0 ran"
    tags = {(call, tag) for _, _, call, tag in log}
    lane0, lane1 = adasum_mod.ADASUM_TAG, adasum_mod.ADASUM_TAG + 1
    assert tags == {(0, lane0), (1, lane1), (2, lane0)}
    for rank in range(world_size):
        events = [(what, call) for r, what, call, _ in log if r == rank]
        assert events.index(("start", 2)) > events.index(("end", 0)), "two calls ran at once in one lane"
    check_three_adasums(world_size, results)


def test_overlapping_adasums_count_their_busy_time_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Adasum calls that each take 0.3 s at once add 0.3 s of busy time, not 0.6 s: busy time
    never exceeds the elapsed time (CommMonitor's comm/share stays in [0, 1])."""
    real_run = adasum_mod._FlatAdasum.run

    def slow_run(self: Any) -> None:
        time.sleep(0.3)
        real_run(self)

    monkeypatch.setattr(adasum_mod._FlatAdasum, "run", slow_run)

    def body(comm: Communicator) -> tuple[float, float]:
        start = time.perf_counter()
        futs = [comm.all_reduce_async(rank_tensors(comm.rank), op="adasum") for _ in range(2)]
        for fut in futs:
            fut.wait()
        return comm.stats.busy_seconds, time.perf_counter() - start

    for busy, elapsed in run_in_threads(2, body):
        assert 0.3 <= busy <= elapsed, f"busy {busy:.3f}s, elapsed {elapsed:.3f}s"


class SerialTagsBackend(TorchBackend):
    """Gloo that claims a pair's operations are serialised, as on NCCL."""

    @property
    @override
    def independent_tags(self) -> bool:
        return False


def test_adasums_run_one_at_a_time_where_tags_are_not_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adasum_mod, "CHUNK_BYTES", 16)
    log, _ = traced_adasum(monkeypatch, hold_first=False)

    def body(comm: Communicator) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        assert isinstance(comm.backend, TorchBackend)
        return three_adasums_and_a_sum(Communicator(SerialTagsBackend(comm.backend.group), stats=comm.stats))

    results = run_in_threads(2, body)
    assert {tag for *_, tag in log} == {adasum_mod.ADASUM_TAG}
    for rank in range(2):
        events = [(what, call) for r, what, call, _ in log if r == rank]
        assert events == [(what, call) for call in range(3) for what in ("start", "end")]
    check_three_adasums(2, results)


def _slow_exchanges(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    real_run = adasum_mod._FlatAdasum.run

    def slow_run(self: Any) -> None:
        time.sleep(seconds)
        real_run(self)

    monkeypatch.setattr(adasum_mod._FlatAdasum, "run", slow_run)


def test_a_call_after_adasums_is_posted_once_they_have_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """An all-reduce posted while two Adasum calls run waits for both (on every rank it is posted
    after them: one order everywhere), and the caller went on while they ran."""
    _slow_exchanges(monkeypatch, 0.2)

    def body(comm: Communicator) -> float:
        start = time.perf_counter()
        futs = [comm.all_reduce_async(rank_tensors(comm.rank), op="adasum") for _ in range(2)]
        returned = time.perf_counter() - start
        futs.append(comm.all_reduce_async(torch.ones(3), "sum"))
        for fut in futs:
            fut.wait()
        return returned

    with trace.recording() as rec:
        returned = run_in_threads(2, body)
    assert max(returned) < 0.2, "the Adasum calls run on their lanes, not in the caller"
    for rank in (0, 1):
        events = [e for e in rec.events if e.rank == rank]
        adasums = [e for e in events if e.op == "adasum"]
        (summed,) = [e for e in events if e.op == "all_reduce"]
        assert len(adasums) == 2 and summed.start_ns >= max(e.end_ns for e in adasums)


def test_a_callback_of_an_adasum_may_post_while_the_next_one_waits_in_its_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One lane (tags not independent): an all-reduce posted from the first Adasum's completion
    callback, on the lane's thread, goes out at once, before the second Adasum queued behind it in
    that lane (waiting for the lane would never end)."""
    _slow_exchanges(monkeypatch, 0.2)

    def body(comm: Communicator) -> tuple[torch.Tensor, list[torch.Tensor]]:
        assert isinstance(comm.backend, TorchBackend)
        serial = Communicator(SerialTagsBackend(comm.backend.group))
        posted: list[Future] = []
        first = serial.all_reduce_async(rank_tensors(comm.rank), op="adasum")
        first.then(lambda _: posted.append(serial.all_reduce_async(torch.ones(2), "sum")))
        second = serial.all_reduce_async(rank_tensors(comm.rank + 10), op="adasum")
        second.wait()
        first.wait()
        return posted[0].wait(), second.value()

    results = run_in_threads(2, body, timeout=30)
    reference = adasum_reference([rank_tensors(r + 10) for r in range(2)])
    for summed, second in results:
        assert torch.equal(summed, torch.full((2,), 2.0))
        for out, ref in zip(second, reference, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def vhdd_bytes(n: int, elsize: int, ntensors: int, rank: int, world: int) -> int:
    """Bytes ``rank`` sends in the exchange for one fused buffer of ``n`` elements."""
    p2 = 1 << (world.bit_length() - 1)
    if rank >= p2:
        return n * elsize
    sent = n * elsize if rank < world - p2 else 0
    lo, hi, level, splits = 0, n, 1, []
    while level < p2:
        left = (rank & level) == 0
        mid = lo + (hi - lo) // 2
        sent += (hi - mid if left else mid - lo) * elsize
        sent += 24 * ntensors * (level.bit_length())
        splits.append((lo, mid, hi, left))
        lo, hi = (lo, mid) if left else (mid, hi)
        level *= 2
    for lo, mid, hi, left in splits:
        sent += (mid - lo if left else hi - mid) * elsize
    return sent


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_counted_are_the_bytes_sent(world_size: int) -> None:
    shapes = [(64,), (36,)]
    results = adasum_threads(world_size, lambda r: rank_tensors(r, shapes=shapes))
    total_sent = total_received = 0
    for rank, (_, snap) in enumerate(results):
        assert snap["adasum.calls"] == 1
        assert snap["adasum.bytes_sent"] == vhdd_bytes(100, 4, 2, rank, world_size)
        total_sent += snap["adasum.bytes_sent"]
        total_received += snap["adasum.bytes_received"]
    assert total_sent == total_received
    if world_size in (2, 4):
        data = 2 * 100 * 4 * (world_size - 1) // world_size
        assert results[0][1]["adasum.bytes_sent"] - data < 24 * 2 * world_size, "O(size) bytes per rank"


def test_module_level_all_reduce_and_world_size_one() -> None:
    comm = Communicator(SingleProcessBackend())
    t = torch.arange(3.0)
    assert comm.all_reduce(t, op="adasum") is t
    torch.testing.assert_close(t, torch.arange(3.0))
    assert adasum_all_reduce(comm.backend, [t]) == (0, 0), "nothing crosses a wire"
    assert comm.stats.bytes_sent == 0


def test_rejects_integer_tensors() -> None:
    def body(comm: Communicator) -> str:
        with pytest.raises(ValueError, match="float16, bfloat16, float32, float64"):
            comm.all_reduce([torch.ones(2), torch.ones(2, dtype=torch.int64)], op="adasum")
        with pytest.raises(ValueError, match="tensor 0 has dtype torch.int32"):  # raised by the call itself
            comm.all_reduce_async(torch.ones(2, dtype=torch.int32), op="adasum")
        return "ok"

    assert run_in_threads(2, body) == ["ok", "ok"]


class RecordingBackend(TorchBackend):
    """A TorchBackend that records which operations it is asked for."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.calls: list[tuple[str, int]] = []

    @override
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Future:
        self.calls.append(("send", tag))
        return super().send(tensor, dst, tag)

    @override
    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Future:
        self.calls.append(("recv", tag))
        return super().recv(tensor, src, tag)

    @override
    def all_reduce(self, tensor: torch.Tensor, op: str, name: Optional[str] = None) -> Future:
        self.calls.append(("all_reduce", 0))
        return super().all_reduce(tensor, op, name)


@pytest.mark.parametrize("world_size", [3, 4])
def test_exchange_uses_only_tagged_send_recv(world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adasum_mod, "CHUNK_BYTES", 64)

    def body(comm: Communicator) -> tuple[list[torch.Tensor], set[tuple[str, int]]]:
        assert isinstance(comm.backend, TorchBackend)
        backend = RecordingBackend(comm.backend.group)
        ts = rank_tensors(comm.rank)
        Communicator(backend, stats=comm.stats).all_reduce(ts, op="adasum")
        return ts, set(backend.calls)

    expected = adasum_reference([rank_tensors(r) for r in range(world_size)])
    for outs, calls in run_in_threads(world_size, body):
        assert calls == {("send", adasum_mod.ADASUM_TAG), ("recv", adasum_mod.ADASUM_TAG)}
        for out, ref in zip(outs, expected, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
