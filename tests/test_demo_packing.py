"""DeMo's packed wire format: bit streams and subset codes round-trip, the packed scheme (sign bits,
group scales, error feedback of what was sent) against a naive Python reference at 1-3 ranks, every
rank decoding the same bits, and the bytes the collectives layer counts over real Gloo groups equal to
``wire_bytes``; plus the vectorised sparse scatter that TopK shares, bitwise the per-rank loop."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.compression import make_compressor, simulate
from lightning_dist.compression.decoupled_momentum import DeMo
from lightning_dist.compression.packing import (
    aligned,
    bit_width,
    pack_uint,
    subset_rank,
    subset_table,
    subset_unrank,
    top_rows,
    unpack_bits,
    unpack_uint,
)
from lightning_dist.compression.sign import pack_bits
from lightning_dist.compression.sparse import gather_sparse_bytes, scatter_ranks
from lightning_dist.compression.wire import reference_bytes

FAST = settings(max_examples=25, deadline=None)


def rank_grads(w: int, shapes: list[tuple[int, ...]], seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(w)]


def run(comps: list[Any], grads: list[list[torch.Tensor]], key: Any = 0) -> list[torch.Tensor]:
    """One simulated exchange; every rank must decode bitwise the same tensors. Returns rank 0's."""
    w = len(comps)
    results = simulate(
        [c.exchange(key, g, world_size=w, rank=r) for r, (c, g) in enumerate(zip(comps, grads))]
    )
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return results[0]


# -- bit streams and subset codes ----------------------------------------------------------------
@FAST
@given(
    bits=st.integers(1, 40),
    n=st.integers(0, 70),
    lead=st.lists(st.integers(1, 3), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_pack_uint_round_trips(bits: int, n: int, lead: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (*lead, n), generator=gen, dtype=torch.int64)
    stream = pack_uint(values, bits)
    assert stream.dtype == torch.uint8 and stream.shape == (*lead, -(-n * bits // 8))
    assert torch.equal(unpack_uint(stream, bits, n), values)


def test_pack_uint_layout_is_little_endian_and_matches_sign_bits() -> None:
    assert pack_uint(torch.tensor([1, 2]), 6).tolist() == [0b1000_0001, 0b0000]
    assert pack_uint(torch.tensor([5]), 3).tolist() == [5]
    assert pack_uint(torch.tensor([0x3FF]), 10).tolist() == [0xFF, 0x03]
    bools = torch.rand(64, generator=torch.Generator().manual_seed(0)) > 0.5
    assert torch.equal(pack_uint(bools, 1), pack_bits(bools)), "same bit order as Sign's payload"
    assert unpack_uint(torch.zeros(3, 0, dtype=torch.uint8), 0, 5).shape == (3, 5)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 5), (8, 3), (10, 1), (9, 4), (16, 8)])
def test_subset_code_is_a_bijection_onto_0_to_c_n_k(n: int, k: int) -> None:
    subsets = torch.tensor(list(itertools.combinations(range(n), k)))
    ranks = subset_rank(subsets, n)
    assert sorted(ranks.tolist()) == list(range(math.comb(n, k)))
    assert torch.equal(subset_unrank(ranks, n, k), subsets)
    assert bit_width(math.comb(n, k)) == (math.ceil(math.log2(math.comb(n, k))) if math.comb(n, k) > 1 else 0)


def test_subset_code_of_large_chunks_round_trips() -> None:
    gen = torch.Generator().manual_seed(1)
    for n, k in [(64, 4), (64, 32), (256, 8), (128, 12)]:
        idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(200)]).sort(dim=-1).values
        ranks = subset_rank(idx.view(2, 100, k), n)
        assert int(ranks.min()) >= 0 and int(ranks.max()) < math.comb(n, k)
        assert torch.equal(subset_unrank(ranks, n, k).view(200, k), idx)


def test_subset_table_row_r_is_subset_r() -> None:
    table = subset_table(10, 3, torch.device("cpu"))
    assert table.dtype == torch.uint8 and table.shape == (120, 3)
    assert torch.equal(table.long(), subset_unrank(torch.arange(120), 10, 3))
    ranks = torch.tensor([[0, 119], [7, 64]])
    assert torch.equal(subset_unrank(ranks, 10, 3, lookup=table), subset_unrank(ranks, 10, 3))


def test_unpack_bits_is_unpack_uint_of_one_bit() -> None:
    bools = torch.rand(2, 21, generator=torch.Generator().manual_seed(2)) > 0.5
    stream = pack_uint(bools, 1)
    assert torch.equal(unpack_bits(stream, 21), bools)
    assert torch.equal(unpack_uint(stream, 1, 21), bools.long())


@pytest.mark.parametrize(("n", "k"), [(64, 4), (64, 1), (8, 8), (300, 3), (1500, 2), (64, 20)])
def test_top_rows_finds_the_k_largest_of_each_column(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, 500, generator=gen)
    before = x.clone()
    got = top_rows(x, k)
    assert torch.equal(x, before), "the input is left as it was"
    assert got.shape == (k, 500)
    ref = x.abs().topk(k, dim=0).indices
    assert torch.equal(got.sort(dim=0).values, ref.sort(dim=0).values)
    picked = x.abs().gather(0, got)
    assert torch.all(picked[:-1] >= picked[1:]), "largest first"
    ties = torch.zeros(n, 3)
    ties[5] = ties[2] = 1.0
    assert set(top_rows(ties, 2)[:, 0].tolist()) == {2, 5}
    special = torch.rand(n, 2, generator=gen)
    special[1, 0], special[n - 1, 1] = -math.inf, math.nan
    assert top_rows(special, 1).tolist() == [[1, n - 1]], "inf and nan come first"


# -- the sparse scatter TopK shares --------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("w", [1, 2, 3, 5])
def test_scatter_ranks_is_bitwise_the_rank_order_loop(w: int, deterministic: bool) -> None:
    gen = torch.Generator().manual_seed(w)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for n, k in [(50, 40), (5000, 3000)]:
            idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(w)]).int()
            val = torch.randn(w, k, generator=gen) * torch.logspace(-6, 6, k)
            loop = torch.zeros(n)
            for i, v in zip(idx.long(), val, strict=True):
                loop[i] += v
            got = scatter_ranks(n, idx, val)
            assert torch.equal(got.view(torch.int32), loop.view(torch.int32))
    finally:
        torch.use_deterministic_algorithms(before)


# -- the packed scheme against a naive reference --------------------------------------------------
def naive_dct_matrix(n: int) -> torch.Tensor:
    d = torch.zeros(n, n, dtype=torch.float64)
    for k in range(n):
        for j in range(n):
            d[k, j] = math.sqrt((1 if k == 0 else 2) / n) * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
    return d


class NaiveDeMo:
    """One rank of the packed scheme, written out chunk by chunk in float64."""

    def __init__(self, chunk_size: int, topk: int, beta: float, values: str, scale_group: int) -> None:
        self.cs, self.k, self.beta, self.values, self.group = chunk_size, topk, beta, values, scale_group
        self.d = naive_dct_matrix(chunk_size)
        self.m: list[torch.Tensor] = []

    def send(self, grads: list[torch.Tensor]) -> list[dict[int, float]]:
        x = torch.cat([g.reshape(-1).double() for g in grads])
        chunks = -(-x.numel() // self.cs)
        x = torch.nn.functional.pad(x, (0, chunks * self.cs - x.numel()))
        if not self.m:
            self.m = [torch.zeros(self.cs, dtype=torch.float64) for _ in range(chunks)]
        picked = []
        for c in range(chunks):
            self.m[c] = self.beta * self.m[c] + self.d @ x[c * self.cs : (c + 1) * self.cs]
            m = self.m[c]
            order = sorted(range(self.cs), key=lambda i: -abs(float(m[i])))
            picked.append({i: float(m[i]) for i in order[: self.k]})
        if self.values == "sign":
            for start in range(0, chunks, self.group):
                group = picked[start : start + self.group]
                scale = sum(abs(v) for p in group for v in p.values()) / sum(len(p) for p in group)
                for p in group:
                    for i in p:
                        p[i] = scale if p[i] >= 0 else -scale
        for c, p in enumerate(picked):
            for i, v in p.items():
                self.m[c][i] -= v
        return picked


def naive_average(ranks_sent: list[list[dict[int, float]]], cs: int, n: int, d: torch.Tensor) -> torch.Tensor:
    chunks = len(ranks_sent[0])
    total = torch.zeros(chunks, cs, dtype=torch.float64)
    for sent in ranks_sent:
        for c, p in enumerate(sent):
            for i, v in p.items():
                total[c, i] += v
    return ((total / len(ranks_sent)) @ d).reshape(-1)[:n]


PACKED_CASES: list[dict[str, Any]] = [
    {"chunk_size": 8, "topk": 2},
    {"chunk_size": 8, "topk": 3, "scale_group": 2},
    {"chunk_size": 16, "topk": 2, "scale_group": 1, "indices": "bits"},
    {"chunk_size": 12, "topk": 4, "scale_group": 100, "indices": "bytes"},
    {"chunk_size": 8, "topk": 2, "values": "fp32", "indices": "subset"},
    {"chunk_size": 8, "topk": 8},
]


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize("options", PACKED_CASES)
def test_packed_scheme_matches_naive_reference(options: dict[str, Any], w: int) -> None:
    """Three steps (momentum, error feedback of what was sent): the averaged update (sign=False),
    its sign (sign=True), and each rank's momentum."""
    shapes = [(5, 7), (11,)]
    n = 46
    opts = {"beta": 0.9, **options}
    full = {"values": "sign", "scale_group": 64, **opts}
    for sign in (False, True):
        comps = [make_compressor("demo", sign=sign, **opts) for _ in range(w)]
        naive = [
            NaiveDeMo(full["chunk_size"], full["topk"], full["beta"], full["values"], full["scale_group"])
            for _ in range(w)
        ]
        for s in range(3):
            grads = rank_grads(w, shapes, 10 * w + s)
            out = torch.cat([o.reshape(-1) for o in run(comps, grads)])
            ref = naive_average(
                [nv.send(g) for nv, g in zip(naive, grads, strict=True)], full["chunk_size"], n, naive[0].d
            )
            if sign:
                clear = ref.abs() > 1e-4
                assert torch.equal(out[clear], ref.sign().float()[clear])
            else:
                torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
            for c, nv in zip(comps, naive, strict=True):
                momentum = c.state_dict()["keys"][0]["momentum"]
                torch.testing.assert_close(momentum, torch.stack(nv.m).float(), atol=1e-5, rtol=1e-5)


def test_overlapping_positions_sum_over_ranks() -> None:
    """Every rank sends the same positions: each is summed over the 3 ranks, the same on all."""
    grads = rank_grads(1, [(40,)], 3) * 3
    scaled = [[grads[0][0] * f] for f in (1.0, 2.0, 3.0)]
    out = run([make_compressor("demo", chunk_size=8, topk=2, sign=False) for _ in range(3)], scaled)[0]
    alone = run([make_compressor("demo", chunk_size=8, topk=2, sign=False)], [scaled[1]])[0]
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=1e-5)  # mean of 1x, 2x, 3x scales = 2x


def test_sign_values_keep_the_rounding_error_in_the_momentum() -> None:
    """With beta=1, what each rank sent plus its momentum is everything it was given."""
    w, shapes = 2, [(9, 9), (5,)]
    comps = [make_compressor("demo", chunk_size=16, topk=2, beta=1.0, sign=False) for _ in range(w)]
    sent = torch.zeros(86, dtype=torch.float64)
    true = torch.zeros(86, dtype=torch.float64)
    d = naive_dct_matrix(16)
    for s in range(8):
        grads = rank_grads(w, shapes, s)
        sent += torch.cat([o.reshape(-1) for o in run(comps, grads)]).double()
        true += sum(torch.cat([g.reshape(-1) for g in gs]).double() for gs in grads) / w
    owed = sum((c.state_dict()["keys"][0]["momentum"].double() @ d).reshape(-1)[:86] for c in comps) / w
    torch.testing.assert_close(sent, true - owed, atol=1e-4, rtol=0)


# -- bytes ---------------------------------------------------------------------------------------
def test_default_layout_bytes() -> None:
    """64/4: 4 sign bits, a 20-bit subset code, one fp32 scale per 64 chunks; the old layout: 5 bytes
    per coefficient."""
    shapes = [(1024, 1024), (1024,)]
    chunks = -(-(1024 * 1024 + 1024) // 64)
    demo = make_compressor("demo")
    row = aligned(4 * -(-chunks // 64)) + aligned(-(-4 * chunks // 8)) + aligned(-(-20 * chunks // 8))
    for w in (1, 2, 4):
        assert demo.wire_bytes(shapes, w) == (w - 1) * row
    old = make_compressor("demo", values="fp32", indices="bytes")
    assert old.wire_bytes(shapes, 3) == gather_sparse_bytes(4 * chunks, torch.uint8, 3)
    assert reference_bytes(shapes, 2) / demo.wire_bytes(shapes, 2) > 83
    assert reference_bytes(shapes, 2) / make_compressor("demo", topk=3).wire_bytes(shapes, 2) > 100
    assert isinstance(demo, DeMo) and demo.index_bits() == 20


CONFIGS: list[dict[str, Any]] = [
    {},
    {"values": "fp32", "indices": "bytes"},
    {"indices": "bits", "scale_group": 3},
    {"chunk_size": 128, "topk": 5, "values": "fp32", "indices": "subset"},
    {"chunk_size": 300, "topk": 2, "indices": "bytes"},
]


@pytest.mark.parametrize("w", [2, 3])
def test_gloo_bytes_counted_equal_wire_bytes_and_ranks_agree(w: int) -> None:
    from lightning_dist.collectives.exchanges import run_exchanges
    from lightning_dist.testing import run_in_threads

    shapes = [(33, 20), (20,), (3, 4, 5)]
    grads = rank_grads(w, shapes, 4)
    expected = [run([make_compressor("demo", **o) for _ in range(w)], grads) for o in CONFIGS]

    def body(comm: Any) -> list[tuple[list[torch.Tensor], int, int, int]]:
        out = []
        for options in CONFIGS:
            c = make_compressor("demo", **options)
            before = comm.stats.bytes_sent
            ex = c.exchange(0, grads[comm.rank], world_size=w, rank=comm.rank)
            run_exchanges(comm, [[ex]]).wait()
            assert ex.result is not None
            out.append((ex.result, comm.stats.bytes_sent - before, ex.wire_bytes, c.wire_bytes(shapes, w)))
        return out

    for per_rank in run_in_threads(w, body):
        for (result, counted, wire, model), exp in zip(per_rank, expected, strict=True):
            assert counted == wire == model
            for o, e in zip(result, exp, strict=True):
                assert torch.equal(o, e), "over Gloo every rank decodes what the simulation does"


def test_bad_options_name_the_option() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"values": "fp16"}, "demo: values='fp16'"),
        ({"indices": "golomb"}, "demo: indices='golomb'"),
        ({"scale_group": 0}, "demo: scale_group=0 must be an integer >= 1"),
        ({"chunk_size": 256, "topk": 64}, "indices='subset' needs C(chunk_size, topk) < 2**62"),
    ]
    for options, message in cases:
        with pytest.raises(
            ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
        ):
            make_compressor("demo", **options)
    make_compressor("demo", chunk_size=256, topk=64, indices="bits")


# -- vectorised fast paths against their plain forms -----------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 64, 1001])
def test_pack_bits_fast_path_matches_weighted_sum(m: int) -> None:
    from lightning_dist.compression.packing import bits_to_bytes

    bools = torch.rand(8 * m + 8, generator=torch.Generator().manual_seed(m)) < 0.5
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    for view in (bools[: 8 * m], bools[8 : 8 * m + 8], bools[1 : 8 * m + 1]):  # aligned and not
        ref = (view.view(-1, 8).to(torch.uint8) * weights).sum(dim=-1, dtype=torch.uint8)
        assert torch.equal(pack_bits(view), ref)
        assert torch.equal(bits_to_bytes(view.to(torch.uint8)), ref)
    assert pack_bits(torch.ones(8, dtype=torch.bool)).item() == 255


def test_unpack_signs_table_matches_shifts() -> None:
    from lightning_dist.compression.sign import unpack_signs

    bits = torch.arange(256, dtype=torch.uint8).repeat(3)
    ref = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1).float().mul_(2).sub_(1)
    assert torch.equal(unpack_signs(bits), ref)
    buf = torch.full((bits.numel() * 8,), 7.0)
    assert torch.equal(unpack_signs(bits, out=buf), ref) and torch.equal(buf, ref)
    positive = torch.rand(800, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(unpack_signs(pack_bits(positive)) > 0, positive)


@pytest.mark.parametrize("n,k", [(64, 4), (20, 3), (9, 2), (16, 1)])
def test_subset_lookup_by_rows_matches_unrank(n: int, k: int) -> None:
    table = subset_table(n, k, torch.device("cpu"))
    ranks = torch.randint(0, math.comb(n, k), (2, 37), generator=torch.Generator().manual_seed(n))
    assert torch.equal(subset_unrank(ranks, n, k, lookup=table), subset_unrank(ranks, n, k))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 9, 12])
def test_ascending_sorts_each_column(k: int) -> None:
    from lightning_dist.compression.decoupled_momentum import _ascending

    gen = torch.Generator().manual_seed(k)
    idx = torch.stack([torch.randperm(64, generator=gen)[:k] for _ in range(50)]).T.contiguous()
    assert torch.equal(_ascending(idx), idx.sort(dim=0).values)


def test_top_rows_with_work_buffer_matches_without() -> None:
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    work = torch.full((64 * 300,), 3.0)
    assert torch.equal(top_rows(x, 4, work=work), top_rows(x, 4))


def test_scatter_ranks_into_a_dirty_buffer_matches_a_fresh_one() -> None:
    idx = torch.tensor([[0, 5, 9], [5, 2, 0]])
    vals = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = torch.full((10,), float("nan"))
    assert torch.equal(scatter_ranks(10, idx, vals, out=out), scatter_ranks(10, idx, vals))
