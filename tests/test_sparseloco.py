"""SparseLoCo pseudo-gradients as pure tensor code, against float64 references with stated bounds:
exactly k kept per chunk (the k largest), 2-bit values within s / 3 of what was kept, positions
round-tripped exactly, error feedback conserving the sum (what was sent plus the last residual is
what came in), the average over ranks as a float64 re-implementation gives it, the payload's bytes
as the formula says, state resumed bitwise, every rank on the same bits (simulated and over Gloo
threads), and DiLoCo taking it by name and as an object."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_dist.compression import SparseLoCo, make_compressor, simulate
from lightning_dist.compression.packing import aligned, bit_width, pack_uint, unpack, unpack_uint
from lightning_dist.compression.sparseloco import LEVELS, chunk_scales, decode_values, encode_values


def inputs(seed: int, n: int, w: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * 1e-2 for _ in range(w)]


def padded(x: torch.Tensor, cs: int) -> torch.Tensor:
    """float64 [chunks, cs], zero-padded."""
    pad = -x.numel() % cs
    return torch.cat([x.double(), torch.zeros(pad, dtype=torch.float64)]).view(-1, cs)


def reference_sent(acc: torch.Tensor, cs: int, k: int) -> torch.Tensor:
    """What one rank sends, dense, in float64: per chunk the k largest |acc|, each at the nearest of
    s * LEVELS with s = the kept absmax rounded up to fp16."""
    rows = padded(acc, cs)
    idx = rows.abs().argsort(dim=-1, descending=True, stable=True)[:, :k]
    kept = rows.gather(-1, idx)
    s = kept.abs().amax(dim=-1)
    s16 = s.to(torch.float16).double()
    s16 = torch.where(s16 < s, torch.nextafter(s.half(), torch.tensor(float("inf")).half()).double(), s16)
    levels = torch.tensor(LEVELS, dtype=torch.float64)
    nearest = (kept.unsqueeze(-1) - s16[:, None, None] * levels).abs().argmin(dim=-1)
    out = torch.zeros_like(rows)
    out.scatter_(-1, idx, s16[:, None] * levels[nearest])
    return out.view(-1)[: acc.numel()]


def test_exactly_k_kept_per_chunk_the_largest_and_positions_round_trip() -> None:
    c = SparseLoCo(ratio=0.05, chunk_size=64)  # k = round(3.2) = 3
    assert c.k == 3 and SparseLoCo().k == 2, "defaults: 3% of 64 -> 2 per chunk"
    x = inputs(0, 64 * 10 + 9)[0]
    ex = c.exchange(0, x, world_size=2)
    assert ex.round is not None
    scale, pos, codes = unpack(ex.round.payload, c.specs(x.numel()))
    chunks = c.chunks(x.numel())
    local = unpack_uint(pos, bit_width(64), chunks * 3).view(chunks, 3)
    assert torch.equal(pack_uint(local.reshape(-1), 6), pos), "positions round-trip exactly"
    rows = padded(x, 64)
    for j in range(chunks):
        chosen = set(local[j].tolist())
        assert len(chosen) == 3, "k distinct positions per chunk"
        assert chosen == set(rows[j].abs().argsort(descending=True)[:3].tolist()), "the k largest"
    assert scale.dtype == torch.float16 and scale.numel() == chunks
    assert codes.numel() == -(-chunks * 3 * 2 // 8), "2 bits a kept value"


@pytest.mark.parametrize("seed", range(4))
def test_two_bit_values_within_a_third_of_the_scale(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kept = torch.randn(200, 3, generator=gen) * torch.logspace(-6, 2, 200).unsqueeze(-1)
    scale = chunk_scales(kept)
    absmax = kept.double().abs().amax(dim=-1)
    assert bool((scale.double() >= absmax).all()), "the scale never under-covers the kept values"
    # up by at most one fp16 ulp: 2**-10 relative, 2**-24 absolute among the subnormals (< 2**-14)
    assert bool((scale.double() <= absmax * (1 + 2**-10) + 2**-24).all()), "rounded up by one ulp at most"
    codes = encode_values(kept, scale)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 3
    err = (decode_values(codes, scale).double() - kept.double()).abs()
    s = scale.double().unsqueeze(-1)
    assert bool((err <= s / 3 * (1 + 2**-20)).all()), (err / s).max()
    assert float((err / s).max()) > 0.25, "the bound is nearly reached"


@pytest.mark.parametrize("w", [1, 2, 3])
def test_average_matches_a_float64_reimplementation_and_ranks_agree(w: int) -> None:
    cs, k, n = 64, 2, 64 * 6 + 11
    comps = [SparseLoCo() for _ in range(w)]
    residual = [torch.zeros(n, dtype=torch.float64) for _ in range(w)]
    for t in range(3):
        xs = inputs(10 * w + t, n, w)
        results = simulate(
            [c.exchange(0, [x], world_size=w, rank=r) for r, (c, x) in enumerate(zip(comps, xs, strict=True))]
        )
        for other in results[1:]:
            assert torch.equal(other[0], results[0][0]), "every rank decodes the same bits"
        sent = []
        for r in range(w):
            acc = xs[r].double() + residual[r]
            sent.append(reference_sent(acc.float(), cs, k))
            residual[r] = acc - sent[r]
        expected = sum(sent) / w
        torch.testing.assert_close(results[0][0].double(), expected, rtol=1e-6, atol=1e-9)
        for r, c in enumerate(comps):
            got = c.state_dict()["keys"][0]["residual"].double()
            torch.testing.assert_close(got, residual[r], rtol=0, atol=1e-8)


def test_error_feedback_conserves_the_sum_of_pseudo_gradients() -> None:
    """sum_t sent_t + residual_T == sum_t x_t (fp32 rounding of one add per step); without error
    feedback the residual is dropped and far more goes missing."""
    n, steps = 64 * 20 + 5, 12
    c, plain = SparseLoCo(), SparseLoCo(error_feedback=False)
    total = torch.zeros(n, dtype=torch.float64)
    sent = torch.zeros(n, dtype=torch.float64)
    sent_plain = torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        x = inputs(t, n)[0]
        total += x.double()
        sent += c.exchange("k", x).run_local()[0].double()
        sent_plain += plain.exchange("k", x).run_local()[0].double()
    residual = c.state_dict()["keys"]["k"]["residual"].double()
    assert "residual" not in plain.state_dict()["keys"]["k"]
    drift = float((sent + residual - total).abs().max())
    assert drift <= steps * 2**-23 * float(total.abs().max() + residual.abs().max()), drift
    missing = float((sent_plain - total).abs().max())
    assert missing > 1e4 * max(drift, 1e-12)


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize(("n", "cs", "ratio"), [(64 * 100, 64, 0.03), (1001, 64, 0.03), (500, 16, 0.25)])
def test_payload_bytes_formula(w: int, n: int, cs: int, ratio: float) -> None:
    """Row = aligned(2 c) + aligned(ceil(c k b / 8)) + aligned(ceil(c k 2 / 8)), c chunks, b bits a
    position; one all-gather: (W - 1) rows sent."""
    c = SparseLoCo(ratio=ratio, chunk_size=cs)
    chunks, k, b = -(-n // cs), c.k, bit_width(cs)
    row = aligned(2 * chunks) + aligned(-(-chunks * k * b // 8)) + aligned(-(-chunks * k * 2 // 8))
    ex = c.exchange(0, torch.randn(n), world_size=w)
    if w > 1:
        assert ex.round is not None and ex.round.payload.nbytes == row
        others = [SparseLoCo(ratio=ratio, chunk_size=cs) for _ in range(1, w)]
        simulate(
            [ex, *[o.exchange(0, torch.randn(n), world_size=w, rank=r + 1) for r, o in enumerate(others)]]
        )
        assert ex.wire_bytes == (w - 1) * row
    assert c.wire_bytes([(n,)], w) == (w - 1) * row
    if (n, w) == (64 * 100, 2):
        # per 64 elements a 2-byte scale, 2 positions of 6 bits, 2 codes of 2 bits; each segment aligned
        assert row == 200 + aligned(150) + aligned(50) == 408


def test_state_resumes_bitwise_and_non_finite_steps_keep_it() -> None:
    n = 64 * 5
    a = SparseLoCo()
    for t in range(3):
        a.exchange(0, inputs(t, n)[0]).run_local()
    saved = a.state_dict()
    b = SparseLoCo()
    b.load_state_dict(saved)
    for t in range(3, 6):
        x = inputs(t, n)[0]
        assert torch.equal(a.exchange(0, x).run_local()[0], b.exchange(0, x).run_local()[0])
    before = a.state_dict()["keys"][0]["residual"].clone()
    bad = inputs(9, n)[0]
    bad[70] = float("nan")
    out = a.exchange(0, bad).run_local()[0]
    assert not bool(torch.isfinite(out).all())
    assert torch.equal(a.state_dict()["keys"][0]["residual"], before), "a skipped step leaves the residual"


@pytest.mark.parametrize("w", [2, 3])
def test_gloo_threads_agree_bitwise_with_the_simulation(w: int) -> None:
    from lightning_dist.collectives.exchanges import run_exchanges
    from lightning_dist.testing import run_in_threads

    n = 64 * 9 + 3
    xs = inputs(3, n, w)
    expected = simulate([SparseLoCo().exchange(0, [x], world_size=w, rank=r) for r, x in enumerate(xs)])

    def body(comm: Any) -> tuple[torch.Tensor, int, int]:
        ex = SparseLoCo().exchange(0, [xs[comm.rank]], world_size=w, rank=comm.rank)
        run_exchanges(comm, [[ex]]).wait()
        assert ex.result is not None
        return ex.result[0], ex.wire_bytes, comm.stats.bytes_sent

    for got, wire, counted in run_in_threads(w, body):
        assert torch.equal(got, expected[0][0])
        assert counted == wire


def test_selectable_by_name_and_object_and_bad_options_fail() -> None:
    from lightning_dist import Compressed, DiLoCo
    from lightning_dist.strategies.fault_tolerant_diloco import FaultTolerantDiLoCo
    from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo

    for cls in (DiLoCo, ShardedDiLoCo, FaultTolerantDiLoCo):
        for value in ("sparseloco", SparseLoCo(ratio=0.1, chunk_size=32)):
            assert cls(compression=value).compressor.name == "sparseloco"  # type: ignore[attr-defined]
    assert Compressed("sparseloco", ratio=0.1).compressor.config.ratio == 0.1
    assert make_compressor("sparseloco").config.chunk_size == 64
    for options, message in (
        ({"ratio": 0}, r"ratio=0 must be in \(0, 1\]"),
        ({"chunk_size": 1}, "chunk_size=1 must be an integer"),
        ({"error_feedback": 1}, "error_feedback=1 must be True or False"),
    ):
        with pytest.raises(ValueError, match=message):
            SparseLoCo(**options)
