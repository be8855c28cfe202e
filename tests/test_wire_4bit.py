"""int4 pseudo-gradients as pure tensor code, against float64 references with stated bounds:
round to nearest within s / 2 per block (s = absmax / 7), the average over ranks within the mean of
the ranks' s / 2 (plus the re-quantisation's s / 2 above two ranks), nibble packing exact, the
payload's bytes as the formula says, every rank on the same bits (simulated and over Gloo threads),
and the strategies that take int8 for DiLoCo taking int4."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_dist.compression import Int4Quantization, make_compressor, simulate
from lightning_dist.compression.int4 import dequantize4, pack_nibbles, quantize4, unpack_nibbles
from lightning_dist.compression.packing import aligned

SLACK = 1 + 2**-20
"""fp32 rounding of x / s and of q * s: a few units in the last place of the bound."""


def blocks64(x: torch.Tensor, cs: int) -> torch.Tensor:
    """``x`` (flat) zero-padded to whole blocks, float64 [blocks, cs]."""
    pad = -x.numel() % cs
    return torch.cat([x.double(), torch.zeros(pad, dtype=torch.float64)]).view(-1, cs)


def inputs(seed: int, n: int, w: int = 1) -> list[torch.Tensor]:
    """Gaussian pseudo-gradients of mixed scale with an outlier per rank."""
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(w):
        x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4) * 1e-2
        x[int(torch.randint(n, (1,), generator=gen))] = 0.3
        xs.append(x)
    return xs


def test_nibbles_round_trip_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8).repeat(3)[torch.randperm(48)]
    packed = pack_nibbles(codes)
    assert packed.shape == (24,) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes)
    assert int(packed[0]) == int(codes[0]) | int(codes[1]) << 4, "element 2i low nibble, 2i + 1 high"


@pytest.mark.parametrize("cs", [2, 16, 64, 1000])
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_within_half_a_step_per_block(cs: int, seed: int) -> None:
    x = inputs(seed, 5 * cs + 3)[0]
    ref = blocks64(x, cs)
    q, scale = quantize4(ref.float())
    assert q.shape == (ref.shape[0], cs // 2) and q.dtype == torch.uint8 and scale.dtype == torch.float32
    codes = unpack_nibbles(q)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15, "codes -7..7 stored as 1..15"
    s = ref.abs().amax(dim=-1) / 7
    torch.testing.assert_close(scale.double(), s, rtol=2**-23, atol=0)
    err = (dequantize4(q, scale).double() - ref).abs().amax(dim=-1)
    assert bool((err <= s / 2 * SLACK).all()), (err / s).max()
    if cs >= 64:
        assert float((err / s.clamp_min(1e-30)).max()) > 0.45, "the bound is nearly reached: the right one"


def test_stochastic_rounding_is_within_a_step_and_unbiased() -> None:
    cs = 64
    x = torch.linspace(-1, 1, cs).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    q, scale = quantize4(x.clone(), gen)
    got = dequantize4(q, scale).double()
    step = scale.double().unsqueeze(-1)
    assert bool(((got - x.double()).abs() <= step * SLACK).all())
    bias = (got - x.double()).mean(dim=0).abs().max()
    # each error has mean 0 and std <= step / 2: the mean of 400 within 4 std of it (0.1 step)
    assert float(bias) < 0.1 * float(step.max()), "rounding noise averages out"


@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_average_over_ranks_within_the_bound(w: int) -> None:
    """At W <= 2 one quantisation: |avg - mean| <= mean_r(s_r) / 2 per block. Above, a second one of
    the averaged shard: plus its s / 2, with its absmax at most mean's plus the first error."""
    cs, n = 64, 64 * 9 + 17
    xs = inputs(w, n, w)
    comps = [make_compressor("int4") for _ in range(w)]
    results = simulate(
        [c.exchange(0, [x], world_size=w, rank=r) for r, (c, x) in enumerate(zip(comps, xs, strict=True))]
    )
    for other in results[1:]:
        assert torch.equal(other[0], results[0][0]), "every rank decodes the same bits"
    mean = sum(blocks64(x, cs) for x in xs) / w
    got = blocks64(results[0][0], cs)
    first = sum(blocks64(x, cs).abs().amax(dim=-1) / 7 for x in xs) / w / 2
    bound = first if w <= 2 else first + (mean.abs().amax(dim=-1) + first) / 7 / 2
    err = (got - mean).abs().amax(dim=-1)
    assert bool((err <= bound * SLACK + 1e-12).all()), (err / bound).max()
    print(f"W={w}: worst block error {float((err / bound).max()):.3f} of the bound")


def test_non_finite_blocks_come_out_non_finite_and_others_do_not() -> None:
    x = torch.randn(256)
    x[3], x[200] = float("inf"), float("nan")
    out = make_compressor("int4").exchange(0, x).run_local()[0]
    assert not bool(torch.isfinite(out[:64]).any()) and not bool(torch.isfinite(out[192:]).any())
    assert bool(torch.isfinite(out[64:192]).all())


@pytest.mark.parametrize("w", [1, 2, 3, 5])
@pytest.mark.parametrize(("n", "cs"), [(64 * 100, 64), (1001, 64), (4096, 128), (7, 2)])
def test_payload_bytes_are_half_a_byte_per_element_plus_scales(w: int, n: int, cs: int) -> None:
    """Row = aligned(4 * blocks) + aligned(shard / 2); at W <= 2 one all-gather of the whole vector,
    above an all-to-all of W rows then an all-gather of one."""
    c = Int4Quantization(chunk_size=cs)
    shards = 1 if w <= 2 else w
    shard = -(-n // (shards * cs)) * cs
    row = aligned(4 * (shard // cs)) + aligned(shard // 2)
    ex = c.exchange(0, torch.randn(n), world_size=w)
    assert ex.round is not None
    assert ex.round.payload.nbytes == (row if shards == 1 else w * row)
    expected = 0 if w == 1 else ((w - 1) * row if w <= 2 else (w - 1) * row + (w - 1) * row)
    assert c.wire_bytes([(n,)], w) == expected
    if n == 64 * 100 and w == 2:
        assert expected == 3200 + 400, "n / 2 bytes of codes and 4 bytes per 64-element block"
        assert c.ratio([(n,)], 2) == pytest.approx((0.5 + 4 / 64) / 4)


@pytest.mark.parametrize("w", [2, 3])
def test_gloo_threads_agree_bitwise_with_the_simulation(w: int) -> None:
    from lightning_dist.collectives.exchanges import run_exchanges
    from lightning_dist.testing import run_in_threads

    xs = inputs(5, 64 * 7 + 5, w)
    expected = simulate(
        [make_compressor("int4").exchange(0, [x], world_size=w, rank=r) for r, x in enumerate(xs)]
    )

    def body(comm: Any) -> tuple[torch.Tensor, int, int]:
        ex = make_compressor("int4").exchange(0, [xs[comm.rank]], world_size=w, rank=comm.rank)
        run_exchanges(comm, [[ex]]).wait()
        assert ex.result is not None
        return ex.result[0], ex.wire_bytes, comm.stats.bytes_sent

    for got, wire, counted in run_in_threads(w, body):
        assert torch.equal(got, expected[0][0])
        assert counted == wire


def test_selectable_wherever_diloco_takes_int8() -> None:
    from lightning_dist import Compressed, DiLoCo
    from lightning_dist.strategies.fault_tolerant_diloco import FaultTolerantDiLoCo
    from lightning_dist.strategies.sharded_diloco import ShardedDiLoCo

    for cls in (DiLoCo, ShardedDiLoCo, FaultTolerantDiLoCo):
        for value in ("int4", "INT4", Int4Quantization(chunk_size=128)):
            assert cls(compression=value).compressor.name == "int4"  # type: ignore[attr-defined]
    assert Compressed("int4", chunk_size=32).compressor.config.chunk_size == 32
    with pytest.raises(ValueError, match="chunk_size=7 must be a positive multiple of 2"):
        Int4Quantization(chunk_size=7)
