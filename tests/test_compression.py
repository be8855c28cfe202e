"""Compressors as pure tensor code: W ranks simulated in process, each result against an independent
reference (the true average, or a naive re-implementation), plus error feedback, state and bytes."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.compression import (
    COMPRESSORS,
    Compressor,
    PowerSGD,
    make_compressor,
    reference_bytes,
    simulate,
)
from lightning_dist.compression.decoupled_momentum import dct_matrix

FAST = settings(max_examples=15, deadline=None)
Grads = list[list[torch.Tensor]]


def rank_grads(world_size: int, shapes: list[tuple[int, ...]], seed: int = 0) -> Grads:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world_size)]


def average(grads: Grads) -> list[torch.Tensor]:
    return [torch.stack([g[i].double() for g in grads]).mean(0).float() for i in range(len(grads[0]))]


def step(comps: list[Compressor], grads: Grads, key: Any = 0) -> list[torch.Tensor]:
    """One exchange on every rank; checks all ranks got the same answer and returns rank 0's."""
    w = len(comps)
    results = simulate(
        [c.exchange(key, g, world_size=w, rank=r) for r, (c, g) in enumerate(zip(comps, grads, strict=True))]
    )
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(
                a, b, rtol=0, atol=0, equal_nan=True, msg="ranks must decode identical tensors"
            )
    return results[0]


def ranks(name: str, w: int, **options: Any) -> list[Compressor]:
    return [make_compressor(name, **options) for _ in range(w)]


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in ts])


# -- options ------------------------------------------------------------------------------------
def test_factory_builds_every_name() -> None:
    for name, cls in COMPRESSORS.items():
        c = make_compressor(name)
        assert isinstance(c, cls) and c.name == name
    assert set(COMPRESSORS) == {
        "none",
        "fp16",
        "bf16",
        "int8",
        "topk",
        "powersgd",
        "sign",
        "demo",
        "int4",
        "sparseloco",
    }
    assert make_compressor("PowerSGD", rank=2).config.rank == 2


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        (
            "bogus",
            {},
            "compressor='bogus' is not known; accepted: none, fp16, bf16, int8, topk, powersgd, sign, demo",
        ),
        ("powersgd", {"rank": 0}, "rank=0 must be an integer >= 1"),
        ("powersgd", {"rank": 2.5}, "rank=2.5 must be an integer >= 1"),
        ("powersgd", {"start_step": -1}, "start_step=-1 must be an integer >= 0"),
        ("powersgd", {"min_compression_rate": -1.0}, "min_compression_rate=-1.0 must be a number >= 0"),
        ("powersgd", {"rnk": 4}, "unknown option 'rnk'; accepted: rank, start_step"),
        ("topk", {"ratio": 1.5}, "ratio=1.5 must be in (0, 1]"),
        ("topk", {"ratio": 0}, "ratio=0 must be in (0, 1]"),
        ("topk", {"error_feedback": 1}, "error_feedback=1 must be True or False"),
        ("int8", {"chunk_size": 0}, "chunk_size=0 must be an integer >= 1"),
        ("sign", {"chunk_size": 12}, "chunk_size=12 must be a positive multiple of 8"),
        ("demo", {"topk": 65}, "topk=65 must be an integer in [1, 64]"),
        ("demo", {"beta": 1.5}, "beta=1.5 must be in [0, 1]"),
        ("fp16", {"ratio": 0.1}, "unknown option 'ratio'; accepted: none"),
        ("powersgd", {"min_compression_rate": math.nan}, "min_compression_rate=nan must be a number >= 0"),
        ("powersgd", {"warm_start": 1}, "powersgd: warm_start=1 must be True or False"),
        ("int8", {"seed": -1}, "int8: seed=-1 must be an integer >= 0"),
        ("sign", {"chunk_size": 8.0}, "chunk_size=8.0 must be a positive multiple of 8"),
        ("demo", {"beta": True}, "demo: beta=True must be in [0, 1]"),
        ("topk", {"ratio": math.nan}, "topk: ratio=nan must be in (0, 1]"),
    ],
)
def test_bad_options_name_the_option(name: str, options: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError) as info:
        make_compressor(name, **options)
    assert expected in str(info.value)


def test_adasum_only_where_allowed() -> None:
    with pytest.raises(
        ValueError, match="adasum=True is not supported; compressors that allow it: none, fp16, bf16"
    ):
        make_compressor("topk").exchange(0, torch.ones(4), adasum=True)
    ex = make_compressor("fp16").exchange(0, torch.full((4,), 3.0), world_size=2, adasum=True)
    assert ex.round is not None and ex.round.op == "adasum"
    assert torch.equal(ex.round.payload, torch.full((4,), 3.0, dtype=torch.float16)), (
        "adasum payloads are not pre-divided"
    )
    with pytest.raises(ValueError, match="rank=2 must be an integer in"):
        make_compressor("none").exchange(0, torch.ones(4), world_size=2, rank=2)


# -- round trips --------------------------------------------------------------------------------
shapes_st = st.lists(
    st.one_of(st.tuples(st.integers(1, 40)), st.tuples(st.integers(1, 12), st.integers(1, 12))),
    min_size=1,
    max_size=3,
)


@FAST
@given(shapes=shapes_st, w=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_none_is_ddp_average_bitwise(shapes: list[tuple[int, ...]], w: int, seed: int) -> None:
    grads = rank_grads(w, shapes, seed)
    out = step(ranks("none", w), grads)
    for i, o in enumerate(out):
        expected = grads[0][i] / w
        for g in grads[1:]:
            expected = expected + g[i] / w
        assert torch.equal(o, expected)


@FAST
@given(
    shapes=shapes_st, w=st.integers(1, 4), seed=st.integers(0, 2**16), name=st.sampled_from(["fp16", "bf16"])
)
def test_casts_within_rounding_bound(shapes: list[tuple[int, ...]], w: int, seed: int, name: str) -> None:
    grads = rank_grads(w, shapes, seed)
    out = step(ranks(name, w), grads)
    unit = 2.0**-11 if name == "fp16" else 2.0**-8
    for i, (o, ref) in enumerate(zip(out, average(grads), strict=True)):
        assert o.dtype == torch.float32 and o.shape == ref.shape
        magnitude = sum(g[i].abs() for g in grads) / w
        assert torch.all((o - ref).abs() <= (w + 1) * unit * magnitude + 1e-7)


@FAST
@given(
    n=st.integers(1, 300),
    w=st.integers(1, 4),
    chunk=st.sampled_from([1, 7, 16, 64]),
    seed=st.integers(0, 2**16),
    stochastic=st.booleans(),
)
def test_int8_within_chunk_bound(n: int, w: int, chunk: int, seed: int, stochastic: bool) -> None:
    grads = rank_grads(w, [(n,)], seed)
    out = step(ranks("int8", w, chunk_size=chunk, stochastic_rounding=stochastic), grads)[0]
    ref = average(grads)[0]
    # error <= mean_i s_i / 2 + s' / 2 <= max_i absmax_i(chunk) / 127 (twice that when rounding randomly)
    chunks = -(-n // chunk)
    padded = torch.stack([torch.nn.functional.pad(g[0], (0, chunks * chunk - n)) for g in grads])
    absmax = padded.abs().view(w, chunks, chunk).amax(-1).amax(0)
    bound = (absmax / 127 * (2 if stochastic else 1) * 1.0001 + 1e-7).repeat_interleave(chunk)[:n]
    assert torch.all((out - ref).abs() <= bound)


def test_int8_stochastic_rounding_is_unbiased() -> None:
    grads = rank_grads(2, [(64,)], 3)
    comps = ranks("int8", 2, chunk_size=64, stochastic_rounding=True)
    outs = torch.stack([step(comps, grads)[0] for _ in range(200)])
    ref = average(grads)[0]
    one_step = (outs[0] - ref).abs().max()
    assert (outs.mean(0) - ref).abs().max() < 0.25 * one_step
    assert not torch.equal(outs[0], outs[1]), "the noise changes from step to step"


def naive_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    order = sorted(range(x.numel()), key=lambda i: -abs(float(x[i])))
    out = torch.zeros_like(x)
    for i in order[:k]:
        out[i] = x[i]
    return out


@FAST
@given(n=st.integers(1, 80), w=st.integers(1, 3), ratio=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
def test_topk_matches_naive_reference(n: int, w: int, ratio: float, seed: int) -> None:
    grads = rank_grads(w, [(n,)], seed)
    out = step(ranks("topk", w, ratio=ratio), grads)[0]
    k = max(1, math.ceil(ratio * n))
    ref = sum(naive_topk(g[0], k) for g in grads) / w
    assert torch.allclose(out, ref, atol=1e-6)
    if k == n:
        assert torch.allclose(out, average(grads)[0], atol=1e-6)


def naive_sign(x: torch.Tensor, chunk: int) -> torch.Tensor:
    out = torch.empty_like(x)
    for start in range(0, x.numel(), chunk):
        part = x[start : start + chunk]
        out[start : start + chunk] = part.abs().mean() * torch.where(part >= 0, 1.0, -1.0)
    return out


@FAST
@given(
    n=st.integers(1, 100), w=st.integers(1, 3), chunk=st.sampled_from([8, 16, 64]), seed=st.integers(0, 2**16)
)
def test_sign_matches_naive_reference(n: int, w: int, chunk: int, seed: int) -> None:
    grads = rank_grads(w, [(n,)], seed)
    out = step(ranks("sign", w, chunk_size=chunk), grads)[0]
    ref = sum(naive_sign(g[0], chunk) for g in grads) / w
    assert torch.allclose(out, ref, atol=1e-6)


def naive_dct(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II of one chunk, straight from the formula, in float64."""
    n = x.numel()
    out = torch.zeros(n, dtype=torch.float64)
    for k in range(n):
        s = sum(float(x[j]) * math.cos(math.pi * (2 * j + 1) * k / (2 * n)) for j in range(n))
        out[k] = s * math.sqrt((1 if k == 0 else 2) / n)
    return out


def naive_idct(c: torch.Tensor) -> torch.Tensor:
    n = c.numel()
    out = torch.zeros(n, dtype=torch.float64)
    for j in range(n):
        out[j] = sum(
            float(c[k]) * math.sqrt((1 if k == 0 else 2) / n) * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
            for k in range(n)
        )
    return out


def test_dct_matrix_is_orthonormal_dct_ii() -> None:
    d = dct_matrix(8, torch.device("cpu"))
    assert torch.allclose(d @ d.T, torch.eye(8), atol=1e-6)
    x = torch.randn(8)
    assert torch.allclose(x @ d.T, naive_dct(x).float(), atol=1e-5)


@pytest.mark.parametrize("sign", [False, True])
def test_demo_first_step_matches_naive_reference(sign: bool) -> None:
    w, n, chunk, k = 3, 21, 8, 2
    grads = rank_grads(w, [(3, 7)], 5)
    out = step(ranks("demo", w, chunk_size=chunk, topk=k, sign=sign, values="fp32"), grads)[0].reshape(-1)
    total = torch.zeros(24, dtype=torch.float64)
    for g in grads:
        x = torch.nn.functional.pad(g[0].reshape(-1), (0, 24 - n))
        for start in range(0, 24, chunk):
            c = naive_dct(x[start : start + chunk])
            keep = torch.zeros_like(c)
            top = sorted(range(chunk), key=lambda i: -abs(float(c[i])))[:k]
            keep[top] = c[top]
            total[start : start + chunk] += naive_idct(keep)
    ref = (total / w)[:n].float()
    if sign:
        clear = ref.abs() > 1e-4
        assert torch.equal(out[clear], ref.sign()[clear])
        assert set(out.unique().tolist()) <= {-1.0, 0.0, 1.0}
    else:
        assert torch.allclose(out, ref, atol=1e-5)


def test_demo_sending_every_coefficient_is_exact() -> None:
    grads = rank_grads(2, [(5, 13), (7,)], 1)
    out = step(ranks("demo", 2, chunk_size=16, topk=16, sign=False, values="fp32"), grads)
    for o, ref in zip(out, average(grads), strict=True):
        assert torch.allclose(o, ref, atol=1e-5)


# -- PowerSGD -----------------------------------------------------------------------------------
@FAST
@given(
    shapes=st.lists(
        st.sampled_from([(6, 4), (4, 6), (3, 2, 5), (5,), (6, 4), (1, 9)]), min_size=1, max_size=4
    ),
    w=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_powersgd_full_rank_equals_average(shapes: list[tuple[int, ...]], w: int, seed: int) -> None:
    comps = ranks("powersgd", w, rank=10, min_compression_rate=0)
    for s in range(2):
        grads = rank_grads(w, shapes, seed + s)
        for o, ref in zip(step(comps, grads), average(grads), strict=True):
            assert torch.allclose(o, ref, atol=1e-5), (o - ref).abs().max()


def test_powersgd_matches_unbatched_reference() -> None:
    """Step 2 (warm Q, residuals from step 1) against a per-matrix loop using torch.linalg.qr."""
    w, r = 3, 2
    shapes = [(8, 6), (8, 6), (5,), (4, 3, 3), (8, 6)]
    comps = ranks("powersgd", w, rank=r, min_compression_rate=1)
    step(comps, rank_grads(w, shapes, 0))
    states = [c.state_dict()["keys"][0] for c in comps]
    grads = rank_grads(w, shapes, 1)
    out = step(comps, grads)
    plan = comps[0].plan(shapes)
    assert [(g.name, g.members) for g in plan.groups] == [("8x6", [0, 1, 4]), ("4x9", [3])]
    assert plan.uncompressed == [2]
    for g in plan.groups:
        q0 = states[0]["q"][g.name]
        for b, i in enumerate(g.members):
            accs = [
                grads[rk][i].reshape(g.rows, g.cols) + states[rk]["residual"][g.name][b] for rk in range(w)
            ]
            p = sum(a @ q0[b] for a in accs)
            p_hat, _ = torch.linalg.qr(p)
            q = sum(a.T @ p_hat for a in accs)
            ref = (p_hat @ q.T / w).reshape(shapes[i])
            assert torch.allclose(out[i], ref, atol=1e-4)
    assert torch.allclose(out[2], average(grads)[2], atol=1e-6)


def test_powersgd_start_step_and_min_compression_rate() -> None:
    w = 2
    shapes = [(32, 32), (4, 4), (10,)]
    comps = ranks("powersgd", w, rank=2, start_step=2)
    for s in range(3):
        grads = rank_grads(w, shapes, s)
        exs = [
            c.exchange(0, g, world_size=w, rank=r) for r, (c, g) in enumerate(zip(comps, grads, strict=True))
        ]
        out = simulate(exs)[0]
        ref = average(grads)
        if s < 2:
            assert exs[0].num_rounds == 1 and exs[0].wire_bytes == reference_bytes(shapes, w)
            assert all(torch.allclose(o, e, atol=1e-6) for o, e in zip(out, ref, strict=True))
        else:
            assert exs[0].num_rounds == 2
            assert not torch.allclose(out[0], ref[0], atol=1e-3), "32x32 at rank 2 is compressed"
            assert torch.allclose(out[1], ref[1], atol=1e-6), "4x4 at rank 2 saves < 2x: sent as is"
            assert torch.allclose(out[2], ref[2], atol=1e-6)


def test_powersgd_low_rank_gradient_is_recovered() -> None:
    w, r = 2, 3
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(40, r, generator=gen) @ torch.randn(r, 30, generator=gen)
    grads = [[base + 0.0], [2 * base]]
    out = step(ranks("powersgd", w, rank=r), grads)[0]
    assert torch.allclose(out, 1.5 * base, atol=1e-4)


def test_powersgd_keeps_input_dtype_and_computes_in_fp32() -> None:
    grads = rank_grads(2, [(16, 12), (12,)], 4)
    half = [[t.bfloat16() for t in g] for g in grads]
    out = step(ranks("powersgd", 2, rank=2), half)
    ref = step(ranks("powersgd", 2, rank=2), [[t.float() for t in g] for g in half])
    for o, e in zip(out, ref, strict=True):
        assert o.dtype == torch.bfloat16
        assert torch.equal(o, e.bfloat16())


# -- error feedback -----------------------------------------------------------------------------
def _ef_run(name: str, steps: int, seed: int = 0, **options: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Sum of outputs and of true averages over ``steps``, and the largest single-step average norm."""
    w = 2
    shapes = [(12, 10), (30,)]
    comps = ranks(name, w, **options)
    gen = torch.Generator().manual_seed(seed)
    drift = [torch.randn(s, generator=gen) for s in shapes]
    sent = torch.zeros(150)
    true = torch.zeros(150)
    biggest = 0.0
    for _ in range(steps):
        grads = [[0.3 * d + torch.randn(d.shape, generator=gen) for d in drift] for _ in range(w)]
        avg = flat(average(grads))
        sent += flat(step(comps, grads))
        true += avg
        biggest = max(biggest, float(avg.norm()))
    return sent, true, biggest


EF_CASES = [
    ("topk", {"ratio": 0.1}),
    ("sign", {"chunk_size": 16}),
    ("powersgd", {"rank": 1}),
    ("demo", {"chunk_size": 16, "topk": 2, "beta": 1.0, "sign": False}),
]


@pytest.mark.parametrize(("name", "options"), EF_CASES)
def test_error_feedback_tracks_the_gradient_sum(name: str, options: dict[str, Any]) -> None:
    steps = 60
    sent, true, biggest = _ef_run(name, steps, **options)
    gap = float((sent - true).norm())
    assert gap <= 12 * biggest, f"residual must stay bounded: {gap} vs one step {biggest}"
    assert gap <= 0.3 * float(true.norm())
    if name != "demo":
        sent_no_ef, _, _ = _ef_run(name, steps, error_feedback=False, **options)
        assert float((sent_no_ef - true).norm()) > 2 * gap, "without error feedback the gap grows"


@pytest.mark.parametrize(("name", "options"), EF_CASES)
def test_error_feedback_residual_is_exactly_what_was_not_sent(name: str, options: dict[str, Any]) -> None:
    """Sum of outputs = sum of average gradients - average final residual (momentum for DeMo)."""
    w = 2
    comps = ranks(name, w, **options)
    shapes = [(12, 10), (30,)]
    sent = torch.zeros(150, dtype=torch.float64)
    true = torch.zeros(150, dtype=torch.float64)
    for s in range(10):
        grads = rank_grads(w, shapes, s)
        sent += flat(step(comps, grads)).double()
        true += flat(average(grads)).double()
    residual = torch.zeros(150, dtype=torch.float64)
    for c in comps:
        entry = c.state_dict()["keys"][0]
        if name == "powersgd":
            res = entry["residual"]["12x10"].reshape(-1)
            residual[:120] += res.double()
        elif name == "demo":
            d = dct_matrix(16, torch.device("cpu")).double()
            residual += (entry["momentum"].double() @ d).reshape(-1)[:150]
        else:
            residual += entry["residual"].double()
    assert torch.allclose(sent, true - residual / w, atol=1e-4)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize(
    ("name", "options"), [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), *EF_CASES]
)
def test_non_finite_gradient_is_reported_and_leaves_state_alone(
    name: str, options: dict[str, Any], bad: float
) -> None:
    """An fp16 overflow must reach the GradScaler (non-finite output) and not poison the state."""
    w, shapes = 2, [(12, 10), (30,)]
    hit, clean = ranks(name, w, **options), ranks(name, w, **options)
    first = rank_grads(w, shapes, 0)
    step(hit, first)
    step(clean, first)
    before = [c.state_dict()["keys"] for c in hit]
    broken = rank_grads(w, shapes, 1)
    broken[1][0][3, 4] = bad
    out = step(hit, broken)
    assert not all(bool(torch.isfinite(o).all()) for o in out)
    for c, old in zip(hit, before, strict=True):
        new = c.state_dict()["keys"]
        for key, entry in old.items():
            for field, value in entry.items():
                if field != "step":
                    assert repr(new[key][field]) == repr(value), f"{field} changed on a skipped step"
    third = rank_grads(w, shapes, 2)
    for a, b in zip(step(hit, third), step(clean, third), strict=True):
        assert torch.equal(a, b)


# -- state --------------------------------------------------------------------------------------
def _is_plain(obj: Any) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, (int, str)) and _is_plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_is_plain(v) for v in obj)
    return isinstance(obj, (torch.Tensor, int, str))


STATE_CASES = [
    ("none", {}),
    ("fp16", {}),
    ("int8", {"chunk_size": 16, "stochastic_rounding": True}),
    ("topk", {"ratio": 0.2}),
    ("powersgd", {"rank": 2}),
    ("powersgd", {"rank": 2, "warm_start": False}),
    ("sign", {"chunk_size": 8}),
    ("demo", {"chunk_size": 8, "topk": 2}),
]


@pytest.mark.parametrize(("name", "options"), STATE_CASES)
def test_state_dict_round_trip_gives_identical_next_outputs(name: str, options: dict[str, Any]) -> None:
    w = 2
    shapes = [(9, 7), (7,)]
    comps = ranks(name, w, **options)
    for s in range(3):
        for key in (0, "b"):
            step(comps, rank_grads(w, shapes, 10 * s + (key == "b")), key)
    saved = []
    for c in comps:
        buf = io.BytesIO()
        torch.save(c.state_dict(), buf)
        saved.append(buf.getvalue())
    assert all(_is_plain(c.state_dict()) for c in comps)
    grads = rank_grads(w, shapes, 99)
    expected = [step(comps, grads, key) for key in (0, "b")]
    fresh = ranks(name, w, **options)
    for c, blob in zip(fresh, saved, strict=True):
        c.load_state_dict(torch.load(io.BytesIO(blob)))
    got = [step(fresh, grads, key) for key in (0, "b")]
    for e_key, g_key in zip(expected, got, strict=True):
        for e, g in zip(e_key, g_key, strict=True):
            assert torch.equal(e, g)
    if name not in ("none", "fp16"):
        assert fresh[0].state_dict()["keys"][0]["step"] == 4


def test_load_state_dict_of_another_compressor_fails() -> None:
    with pytest.raises(ValueError, match="state_dict is for compressor 'topk'"):
        make_compressor("sign").load_state_dict(make_compressor("topk").state_dict())


def test_merge_states_keeps_the_averaged_residual_for_a_new_world_size() -> None:
    """Error feedback owed to the averaged update, mean(e_i), is what every rank of the new world
    size holds after the merge; a tensor all ranks share stays bitwise; other values come from rank 0."""
    ranks = [make_compressor("powersgd", rank=1) for _ in range(3)]
    exchanges = [
        c.exchange(0, torch.randn(6, 5, generator=torch.Generator().manual_seed(r)), world_size=3, rank=r)
        for r, c in enumerate(ranks)
    ]
    simulate(exchanges)
    states = [c.state_dict() for c in ranks]
    merged = ranks[0].merge_states(states)

    def leaves(tree: Any, path: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{path}/{key}").items()}
        if isinstance(tree, list):
            return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, f"{path}/{i}").items()}
        return {path: tree}

    per_rank = [leaves(s["keys"]) for s in states]
    got = leaves(merged["keys"])
    assert got.keys() == per_rank[0].keys()
    averaged = 0
    for path, first in per_rank[0].items():
        values = [r[path] for r in per_rank]
        if isinstance(first, torch.Tensor) and not all(torch.equal(first, v) for v in values):
            assert torch.equal(got[path], torch.stack(values).mean(0)), path
            averaged += 1
        elif isinstance(first, torch.Tensor):
            assert torch.equal(got[path], first), path
        else:
            assert got[path] == first, path
    assert averaged > 0, "per-rank residuals differ, so some state must be averaged"
    fresh = make_compressor("powersgd", rank=1)
    fresh.load_state_dict(merged)
    assert fresh.state_dict()["keys"][0]["step"] == 1
    partial = [states[0], {**states[1], "keys": {}}]
    assert ranks[0].merge_states(partial)["keys"] == {}, "a key not every rank holds starts afresh"
    with pytest.raises(ValueError, match="merge_states got a state of 'topk'"):
        ranks[0].merge_states([make_compressor("topk").state_dict()])


def test_changed_shapes_under_a_key_restart_its_state() -> None:
    c = make_compressor("topk", ratio=0.5)
    c.exchange(0, torch.randn(10)).run_local()
    out = c.exchange(0, [torch.randn(3, 4)]).run_local()
    assert out[0].shape == (3, 4)
    entry = c.state_dict()["keys"][0]
    assert entry["step"] == 2 and entry["residual"].shape == (12,)


# -- bytes and the protocol ---------------------------------------------------------------------
@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("w", [1, 2, 3, 5])
def test_wire_bytes_formula_matches_payloads(name: str, w: int) -> None:
    shapes = [(33, 20), (20,), (33, 20), (3, 4, 5)]
    comps = ranks(name, w)
    grads = rank_grads(w, shapes, w)
    exs = [c.exchange(0, g, world_size=w, rank=r) for r, (c, g) in enumerate(zip(comps, grads, strict=True))]
    simulate(exs)
    assert exs[0].wire_bytes == comps[0].wire_bytes(shapes, w)
    if w == 1:
        assert exs[0].wire_bytes == 0


def test_ratios_against_fp32_ring() -> None:
    shapes = [(1024, 1024), (1024,)]
    w = 4
    ratio = {name: make_compressor(name).ratio(shapes, w) for name in COMPRESSORS}
    assert ratio["none"] == 1.0
    assert ratio["fp16"] == ratio["bf16"] == 0.5
    assert 0.25 < ratio["int8"] < 0.26
    assert ratio["topk"] == pytest.approx(w * 8 * 0.01 / 8, rel=0.01)
    assert ratio["sign"] == pytest.approx(w * (1 / 8 + 4 / 1024) / 8, rel=0.01)
    # per chunk of 64: 4 sign bits, a 20-bit code of the 4 positions, 1/64 of an fp32 scale
    assert ratio["demo"] == pytest.approx(w * ((4 + 20) / 8 + 4 / 64) / 64 / 8, rel=0.01)
    fp32_values = make_compressor("demo", values="fp32", indices="bytes").ratio(shapes, w)
    assert fp32_values == pytest.approx(w * (4 * 5 / 64) / 8, rel=0.01)  # fp32 value + uint8 index
    n = 1024 * 1024
    assert ratio["powersgd"] == pytest.approx((2 * 1024 * 4 + 1024) / (n + 1024), rel=0.01)


def test_exchange_protocol() -> None:
    c = make_compressor("topk", ratio=0.5)
    ex = c.exchange(0, torch.arange(6.0), world_size=2)
    assert ex.round is not None and ex.round.kind == "allgather" and ex.round.payload.dtype == torch.uint8
    with pytest.raises(ValueError, match="one row per rank"):
        ex.feed([ex.round.payload])
    ex.feed([ex.round.payload, torch.zeros_like(ex.round.payload)])
    assert ex.done and ex.result is not None
    assert torch.equal(ex.result[0], torch.tensor([0, 0, 0, 3, 4, 5]) / 2)
    with pytest.raises(RuntimeError, match="finished"):
        ex.feed(torch.zeros(1))
    with pytest.raises(RuntimeError, match="world size 2"):
        c.exchange(0, torch.ones(4), world_size=2).run_local()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_world_size_one_local_run_keeps_dtype_and_shape(name: str, dtype: torch.dtype) -> None:
    ts = [torch.randn(6, 5).to(dtype), torch.randn(5).to(dtype)]
    copies = [t.clone() for t in ts]
    out = make_compressor(name).exchange("k", ts).run_local()
    assert [o.shape for o in out] == [t.shape for t in ts]
    assert all(o.dtype == dtype for o in out)
    assert all(torch.equal(t, c) for t, c in zip(ts, copies, strict=True)), "inputs are never written"
    ex = make_compressor(name).exchange("e", [torch.zeros(0), torch.zeros(2, 0)], world_size=2)
    assert ex.done and ex.num_rounds == 0 and [o.shape for o in ex.result or []] == [(0,), (2, 0)]


# -- over a real transport ----------------------------------------------------------------------
@pytest.mark.parametrize("w", [2, 3])
@pytest.mark.parametrize("name", ["none", "fp16", "int8", "powersgd", "topk", "sign", "demo"])
def test_gloo_driver_matches_simulation_and_counters(name: str, w: int) -> None:
    """``collectives.exchanges.run_exchanges`` (what the DDP hook and Horovod use) over real Gloo
    groups gives bitwise the simulated results, two calls chained with ``after``, bytes as modelled."""
    from lightning_dist.collectives.exchanges import run_exchanges, start_round
    from lightning_dist.testing import run_in_threads

    shapes = [[(16, 12), (12,)], [(9, 7)], [(40,)]]
    grads = [rank_grads(w, s, 7 + i) for i, s in enumerate(shapes)]
    reference = ranks(name, w)
    expected = [step(reference, g, key=i) for i, g in enumerate(grads)]

    def body(comm: Any) -> tuple[list[list[torch.Tensor]], int, int]:
        c = make_compressor(name)
        exs = [c.exchange(i, g[comm.rank], world_size=w, rank=comm.rank) for i, g in enumerate(grads)]
        first = run_exchanges(comm, [[exs[0]], [exs[1]]], inflight=start_round(comm, [exs[0]]))
        run_exchanges(comm, [[exs[2]]], after=first).wait()
        assert all(ex.result is not None for ex in exs)
        return [ex.result for ex in exs], sum(ex.wire_bytes for ex in exs), comm.stats.bytes_sent

    for outs, wire, counted in run_in_threads(w, body):
        for out, exp in zip(outs, expected, strict=True):
            for o, e in zip(out, exp, strict=True):
                # bitwise at 2 ranks; Gloo sums 3 ranks in another order than the simulation (an fp16
                # wire word may then round one unit in the last place apart)
                tol = 0.0 if w == 2 else (2e-3 if name == "fp16" else 1e-6)
                torch.testing.assert_close(o, e, rtol=tol, atol=tol)
        # every round's shapes are known on every rank: no shape or row-count exchange (int8's
        # all_to_all from 3 ranks included), exactly the wire model
        assert counted == wire


def test_gloo_driver_reports_errors_through_the_future() -> None:
    from lightning_dist.collectives.exchanges import run_exchanges
    from lightning_dist.testing import run_in_threads

    def body(comm: Any) -> str:
        ex = make_compressor("none").exchange(0, [torch.ones(3)], world_size=2, rank=comm.rank)
        ex.round.kind = "bogus"  # type: ignore[union-attr,assignment]
        fut = run_exchanges(comm, [[ex]])
        with pytest.raises(Exception) as info:
            fut.wait()
        return str(info.value)

    for message in run_in_threads(2, body):
        assert message


def test_powersgd_object_and_factory_agree() -> None:
    grads = rank_grads(2, [(10, 8)], 2)
    a = step([PowerSGD(rank=3), PowerSGD(rank=3)], grads)
    b = step(ranks("powersgd", 2, rank=3), grads)
    assert torch.equal(a[0], b[0])


# -- CPU fast paths: sampled top-k threshold, scratch reuse ---------------------------------------
@pytest.mark.parametrize("margin", [1.5, 1.0, 0.05], ids=["sampled", "tight", "fallback"])
@pytest.mark.parametrize("k", [1, 7, 400])
def test_sampled_topk_threshold_selects_exactly_the_k_largest(margin: float, k: int) -> None:
    from lightning_dist.compression.topk import largest_magnitudes

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3000, generator=gen) * torch.rand(3000, generator=gen)
    x[::5] *= 10.0  # structure aligned with the sample stride must not matter
    idx = largest_magnitudes(x, k, stride=5, margin=margin, min_numel=1)
    assert idx.numel() == k and idx.unique().numel() == k
    out = torch.zeros_like(x).index_copy_(0, idx, x[idx])
    assert torch.equal(out, naive_topk(x, k))


def test_sampled_topk_falls_back_when_the_threshold_is_too_high() -> None:
    from lightning_dist.compression.topk import largest_magnitudes

    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    x[::7] = 100.0 + torch.arange(x[::7].numel()).float()  # every sampled entry is huge: threshold too high
    k = 800  # more than the 715 huge entries: fewer than k candidates pass
    idx = largest_magnitudes(x, k, stride=7, min_numel=1)
    out = torch.zeros_like(x).index_copy_(0, idx, x[idx])
    assert torch.equal(out, naive_topk(x, k))


def test_sampled_topk_counts_nan_and_inf_as_largest() -> None:
    from lightning_dist.compression.topk import largest_magnitudes

    x = torch.randn(4000, generator=torch.Generator().manual_seed(2))
    x[17], x[2000], x[3999] = float("nan"), float("inf"), float("-inf")
    idx = set(largest_magnitudes(x, 10, stride=3, min_numel=1).tolist())
    assert {17, 2000, 3999} <= idx
    assert idx == set(x.abs().topk(10).indices.tolist())


def test_topk_large_bucket_matches_full_topk_over_steps() -> None:
    """Above the sampling size the bucket takes the threshold path: the result and the residual
    stay those of a full ``topk`` (continuous random values: no ties)."""
    n, w = 100_003, 2
    comps = ranks("topk", w, ratio=0.01)
    gen = torch.Generator().manual_seed(3)
    residual = [torch.zeros(n) for _ in range(w)]
    k = math.ceil(0.01 * n)
    for _ in range(3):
        grads = [[torch.randn(n, generator=gen)] for _ in range(w)]
        ref = torch.zeros(n)
        for r in range(w):
            acc = grads[r][0] + residual[r]
            idx = acc.abs().topk(k).indices
            ref.index_add_(0, idx, acc[idx])
            residual[r] = acc.index_fill(0, idx, 0.0)
        out = step(comps, grads)[0]
        assert torch.equal(out, ref / w)
        for r in range(w):
            assert torch.equal(comps[r].state_dict()["keys"][0]["residual"], residual[r])


def test_compressors_leave_their_inputs_unchanged() -> None:
    """The fast paths read whole-chunk fp32 inputs in place and reuse buffers: never the input."""
    for name in ("topk", "sign", "demo"):
        comps = ranks(name, 2)
        for s in range(3):
            grads = rank_grads(2, [(128 * 1024,)], s)
            before = [g[0].clone() for g in grads]
            step(comps, grads)
            for g, b in zip(grads, before, strict=True):
                assert torch.equal(g[0], b), name


def test_demo_reused_scratch_does_not_leak_into_results() -> None:
    """Two keys of one size share nothing: each bucket's answer is that of a fresh compressor."""
    grads = rank_grads(2, [(64 * 40,)], 4)
    other = rank_grads(2, [(64 * 40,)], 5)
    reused = ranks("demo", 2)
    step(reused, other, key="a")
    step(reused, grads, key="b")
    step(reused, other, key="a")
    fresh = ranks("demo", 2)
    step(fresh, grads, key="b")
    assert torch.equal(step(reused, grads, key="b")[0], step(fresh, grads, key="b")[0])
