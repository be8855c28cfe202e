"""ElasticPlan and ElasticSampler: every sample once per epoch across failures and world sizes, step s
the same samples on every world size that divides the global batch, the indivisible fallbacks."""

from __future__ import annotations

import io
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.elastic.sampler import (
    ElasticBatchWarning,
    ElasticPlan,
    ElasticSampler,
    epoch_order,
    per_rank_split,
)


def quiet_plan(*args: int, **kwargs: Any) -> ElasticPlan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ElasticBatchWarning)
        return ElasticPlan(*args, **kwargs)


def steps_of(plan: ElasticPlan, samplers: list[ElasticSampler]) -> list[list[list[int]]]:
    """Per step, per rank, the rank's indices of the step, read by iterating each rank's sampler."""
    per_rank = []
    for sampler in samplers:
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(len(batch) == plan.micro for batch in batches)
        a = plan.accumulate
        per_rank.append([sum(batches[i : i + a], []) for i in range(0, len(batches), a)])
    return [list(step) for step in zip(*per_rank)]


# -- plan arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("share", "micro_batch", "expected"),
    [
        (24, 32, (1, 24)),
        (48, 32, (2, 24)),
        (96, 32, (3, 32)),
        (7, 3, (7, 1)),
        (1, 5, (1, 1)),
        (30, 7, (5, 6)),
    ],
)
def test_per_rank_split(share: int, micro_batch: int, expected: tuple[int, int]) -> None:
    assert per_rank_split(share, micro_batch) == expected


@given(share=st.integers(1, 2000), micro_batch=st.integers(1, 300))
@settings(max_examples=200, deadline=None)
def test_per_rank_split_is_the_smallest_exact_accumulation(share: int, micro_batch: int) -> None:
    a, m = per_rank_split(share, micro_batch)
    assert a * m == share and m <= micro_batch
    assert not any(share % b == 0 and share // b <= micro_batch for b in range(1, a))


@pytest.mark.parametrize(
    ("world_size", "accumulate", "micro"),
    [(1, 3, 32), (2, 2, 24), (3, 1, 32), (4, 1, 24), (6, 1, 16), (12, 1, 8)],
)
def test_divisible_world_sizes_keep_the_global_batch(world_size: int, accumulate: int, micro: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = ElasticPlan(
            dataset_len=1000, global_batch=96, world_size=world_size, micro_batch=32, base_world_size=4
        )
    assert (plan.accumulate, plan.micro) == (accumulate, micro)
    assert plan.effective_global_batch == world_size * accumulate * micro == 96
    assert plan.lr_scale == 1.0 and plan.divisible
    assert plan.steps_per_epoch == 1000 // 96


def test_keep_per_rank_fallback_scales_the_lr_and_warns() -> None:
    plan = ElasticPlan(dataset_len=1000, global_batch=96, world_size=4, micro_batch=32)
    with pytest.warns(ElasticBatchWarning) as caught:
        five = plan.for_world_size(5)
    assert (five.accumulate, five.micro, five.effective_global_batch) == (1, 24, 120)
    assert five.lr_scale == 1.25 and not five.divisible
    assert five.base_world_size == 4 and five.global_batch == 96
    text = str(caught[0].message)
    for part in ("global_batch=96", "world_size=5", "base_world_size=4", "1 x 24", "120 samples", "1.25"):
        assert part in text, (part, text)
    assert "on_indivisible='error'" in text


def test_keep_per_rank_keeps_the_base_accumulation() -> None:
    plan = ElasticPlan.from_per_rank(dataset_len=1000, batch_size=8, accumulate_grad_batches=3, world_size=2)
    assert plan.global_batch == 48 and (plan.accumulate, plan.micro) == (3, 8)
    with pytest.warns(ElasticBatchWarning, match=r"scaled by 120/48 = 2\.5"):
        five = plan.for_world_size(5)
    assert (five.accumulate, five.micro, five.effective_global_batch, five.lr_scale) == (3, 8, 120, 2.5)


@pytest.mark.parametrize(
    ("global_batch", "world_size", "effective", "accumulate", "micro"),
    [(96, 5, 95, 1, 19), (96, 7, 91, 1, 13), (12, 5, 10, 1, 2), (4, 5, 5, 1, 1), (200, 3, 198, 3, 22)],
)
def test_round_global_fallback(
    global_batch: int, world_size: int, effective: int, accumulate: int, micro: int
) -> None:
    with pytest.warns(ElasticBatchWarning, match="round_global") as caught:
        plan = ElasticPlan(
            dataset_len=1000,
            global_batch=global_batch,
            world_size=world_size,
            micro_batch=32,
            base_world_size=1,
            on_indivisible="round_global",
        )
    assert (plan.effective_global_batch, plan.accumulate, plan.micro) == (effective, accumulate, micro)
    assert plan.lr_scale == effective / global_batch
    assert f"{plan.lr_scale:.6g}" in str(caught[0].message)


def test_error_override_refuses_an_indivisible_world_size() -> None:
    plan = ElasticPlan(
        dataset_len=1000, global_batch=96, world_size=4, micro_batch=32, on_indivisible="error"
    )
    assert plan.for_world_size(3).effective_global_batch == 96
    with pytest.raises(ValueError, match=r"global_batch=96 is not divisible by world_size=5.*on_indivisible"):
        plan.for_world_size(5)


def test_a_share_without_a_divisor_near_micro_batch_warns() -> None:
    with pytest.warns(ElasticBatchWarning, match="127 micro-batches of 1"):
        plan = ElasticPlan(dataset_len=1000, global_batch=254, world_size=2, micro_batch=64)
    assert (plan.accumulate, plan.micro) == (127, 1)


def test_drop_last_false_counts_the_partial_step() -> None:
    plan = ElasticPlan(dataset_len=100, global_batch=30, world_size=3, micro_batch=10, drop_last=False)
    assert plan.steps_per_epoch == 4
    assert ElasticPlan(dataset_len=100, global_batch=30, world_size=3, micro_batch=10).steps_per_epoch == 3
    # a step larger than the dataset is allowed when it wraps round
    assert (
        ElasticPlan(
            dataset_len=5, global_batch=8, world_size=2, micro_batch=4, drop_last=False
        ).steps_per_epoch
        == 1
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset_len": 0}, r"dataset_len=0 must be an integer >= 1"),
        ({"global_batch": 2.0}, r"global_batch=2.0 must be an integer >= 1"),
        ({"world_size": 0}, r"world_size=0 must be an integer >= 1"),
        ({"micro_batch": True}, r"micro_batch=True must be an integer >= 1"),
        ({"drop_last": 1}, r"drop_last=1 must be True or False"),
        ({"base_world_size": 0}, r"base_world_size=0 must be an integer >= 1"),
        ({"on_indivisible": "scale"}, r"on_indivisible='scale' is not supported; accepted: 'keep_per_rank'"),
        (
            {"global_batch": 10, "base_world_size": 4},
            r"global_batch=10 must be a multiple of base_world_size=4",
        ),
        ({"global_batch": 10, "world_size": 3}, r"global_batch=10 must be a multiple of base_world_size=3"),
        ({"dataset_len": 50}, r"global_batch=64 .* must be at most dataset_len=50 with drop_last=True"),
    ],
)
def test_bad_plan_arguments_name_the_argument(kwargs: dict[str, Any], message: str) -> None:
    args = {"dataset_len": 100, "global_batch": 64, "world_size": 2, "micro_batch": 16, **kwargs}
    with pytest.raises(ValueError, match=rf"^elastic: {message}"):
        ElasticPlan(**args)


def test_an_indivisible_fallback_larger_than_the_dataset_is_refused() -> None:
    plan = ElasticPlan(dataset_len=100, global_batch=96, world_size=4, micro_batch=24)
    with (
        pytest.raises(ValueError, match="a step takes 120 samples on world_size=5"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", ElasticBatchWarning)
        plan.for_world_size(5)


def test_from_per_rank_checks_its_own_arguments() -> None:
    with pytest.raises(ValueError, match="accumulate_grad_batches=0"):
        ElasticPlan.from_per_rank(100, 4, 0, 2)


# -- order and layout ------------------------------------------------------------------------------


def test_epoch_order_is_a_permutation_seeded_by_seed_and_epoch() -> None:
    order = epoch_order(1000, seed=3, epoch=2)
    assert sorted(order.tolist()) == list(range(1000))
    assert torch.equal(order, epoch_order(1000, seed=3, epoch=2))
    assert not torch.equal(order, epoch_order(1000, seed=3, epoch=3))
    assert not torch.equal(epoch_order(1000, seed=0, epoch=1), epoch_order(1000, seed=1, epoch=0))
    assert epoch_order(5, seed=0, epoch=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_layout_rank_r_reads_block_k_times_world_plus_r() -> None:
    plan = ElasticPlan(dataset_len=18, global_batch=8, world_size=2, micro_batch=2)
    assert (plan.accumulate, plan.micro) == (2, 2)
    rank0, rank1 = (ElasticSampler(plan, r, shuffle=False) for r in range(2))
    assert list(rank0) == [[0, 1], [4, 5], [8, 9], [12, 13]]
    assert list(rank1) == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert rank0.rank_batches(1, rank=1) == [[10, 11], [14, 15]]
    assert rank0.step_indices(1) == list(range(8, 16))
    assert (len(rank0), rank0.num_steps, rank0.num_samples) == (4, 2, 8)


def test_drop_last_false_wraps_the_last_step_round_to_the_epoch_start() -> None:
    plan = ElasticPlan(dataset_len=10, global_batch=4, world_size=2, micro_batch=2, drop_last=False)
    samplers = [ElasticSampler(plan, r, shuffle=False) for r in range(2)]
    assert samplers[0].step_indices(2) == [8, 9, 0, 1]
    assert list(samplers[1]) == [[2, 3], [6, 7], [0, 1]]
    used = Counter(i for s in samplers for batch in s for i in batch)
    assert used == Counter({**dict.fromkeys(range(10), 1), 0: 2, 1: 2})


def test_a_dataloader_reads_the_micro_batches() -> None:
    plan = ElasticPlan(dataset_len=40, global_batch=12, world_size=3, micro_batch=2)
    sampler = ElasticSampler(plan, rank=1, seed=5, epoch=1)
    loader: DataLoader[tuple[torch.Tensor, ...]] = DataLoader(
        TensorDataset(torch.arange(100, 140)), batch_sampler=sampler
    )
    assert len(loader) == len(sampler) == plan.steps_per_epoch * plan.accumulate
    assert [batch.tolist() for (batch,) in loader] == [[100 + i for i in batch] for batch in sampler]


# -- steps across world sizes, restarts and epochs -------------------------------------------------


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_step_s_reads_the_same_samples_on_every_divisor_world_size(data: st.DataObject) -> None:
    per_rank, base_world, micro_batch = (data.draw(st.integers(1, top)) for top in (12, 4, 8))
    extra = data.draw(st.integers(0, 60))
    world_sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    seed, epoch = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    drop_last = data.draw(st.booleans())
    g = base_world * per_rank
    plan = quiet_plan(
        dataset_len=g + extra,
        global_batch=g,
        world_size=base_world,
        micro_batch=micro_batch,
        drop_last=drop_last,
    )
    reference = ElasticSampler(plan, 0, seed=seed, epoch=epoch)
    expected = [sorted(reference.step_indices(s)) for s in range(plan.steps_per_epoch)]
    for w in {w for w in world_sizes if g % w == 0} | {1, base_world}:
        other = quiet_plan(
            dataset_len=g + extra, global_batch=g, world_size=w, micro_batch=micro_batch, drop_last=drop_last
        )
        assert other.divisible and other.steps_per_epoch == plan.steps_per_epoch
        samplers = [ElasticSampler(other, r, seed=seed, epoch=epoch) for r in range(w)]
        steps = steps_of(other, samplers)
        assert len(steps) == plan.steps_per_epoch
        for s, ranks in enumerate(steps):
            union = [i for rank in ranks for i in rank]
            assert sorted(union) == expected[s]  # ranks' micro-batches: disjoint, together the step
            for r, rank in enumerate(ranks):
                assert rank == sum(samplers[0].rank_batches(s, rank=r), [])


segment = st.tuples(st.integers(1, 6), st.integers(0, 12), st.integers(0, 12))


@given(
    per_rank=st.integers(1, 10),
    base_world=st.integers(1, 4),
    micro_batch=st.integers(1, 6),
    dataset_len=st.integers(1, 250),
    segments=st.lists(segment, max_size=5),
    last_world=st.integers(1, 6),
    seed=st.integers(0, 1000),
    on_indivisible=st.sampled_from(["keep_per_rank", "round_global"]),
    divisors_only=st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_every_sample_once_across_failures_and_world_sizes(
    per_rank: int,
    base_world: int,
    micro_batch: int,
    dataset_len: int,
    segments: list[tuple[int, int, int]],
    last_world: int,
    seed: int,
    on_indivisible: str,
    divisors_only: bool,
) -> None:
    """Run the epoch as segments (world size, steps run before a failure, steps committed); the last
    segment runs to the end. The final trajectory (each step as last run) reads every sample once."""
    g = base_world * per_rank

    def plan_for(w: int) -> ElasticPlan:
        if divisors_only and g % w:
            w = base_world
        # ElasticPlan(dataset_len, global_batch, world_size, micro_batch, ...)
        return quiet_plan(
            dataset_len, g, w, micro_batch, base_world_size=base_world, on_indivisible=on_indivisible
        )

    try:
        first = plan_for(base_world)
    except ValueError:  # the global batch is larger than the dataset
        return
    reference = ElasticSampler(first, 0, seed=seed, epoch=2)
    final: dict[int, list[int]] = {}
    state = None
    last_effective = first.effective_global_batch
    for world, ran, committed in [*segments, (last_world, None, None)]:
        try:
            plan = plan_for(world)
        except ValueError:  # this world size's fallback step exceeds the dataset
            if committed is not None:
                continue
            plan = first
        samplers = [ElasticSampler(plan, r, seed=seed, epoch=2) for r in range(plan.world_size)]
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(state)
        start = samplers[0].start_step
        final = {s: v for s, v in final.items() if s < start}  # steps after the commit are redone
        steps = steps_of(plan, samplers)
        ran = len(steps) if ran is None else min(ran, len(steps))
        for i in range(ran):
            final[start + i] = [idx for rank in steps[i] for idx in rank]
            if plan.divisible and samplers[0].position(start) == start * g:
                assert sorted(final[start + i]) == sorted(reference.step_indices(start + i))
        if committed is None:
            last_effective = plan.effective_global_batch
            end_position = samplers[0].position(samplers[0].end_step)
            break
        state = samplers[0].state_dict(step=start + min(committed, ran))
        assert all(s.state_dict(step=start + min(committed, ran)) == state for s in samplers)
    else:  # pragma: no cover - the last segment never fails
        raise AssertionError("no segment ran to the end")
    assert sorted(final) == list(range(len(final)))
    used = Counter(i for step in final.values() for i in step)
    assert set(used.values()) <= {1}
    order = epoch_order(dataset_len, seed=seed, epoch=2).tolist()
    assert sorted(used) == sorted(order[:end_position])
    assert dataset_len - end_position < last_effective  # the tail: less than one step
    if divisors_only or (all(g % w == 0 for w, _, _ in segments) and g % last_world == 0):
        assert dataset_len - end_position == dataset_len % g


def test_a_resumed_sampler_continues_where_the_commit_was() -> None:
    plan = ElasticPlan(dataset_len=100, global_batch=12, world_size=2, micro_batch=3)
    full = ElasticSampler(plan, 1, seed=7, epoch=4)
    state = full.state_dict(step=3)
    assert state == {"epoch": 4, "step": 3, "position": 36, "seed": 7, "global_batch": 12, "dataset_len": 100}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    resumed = ElasticSampler(plan, 1)
    resumed.load_state_dict(loaded)
    assert (resumed.seed, resumed.epoch, resumed.start_step, resumed.start_position) == (7, 4, 3, 36)
    assert list(resumed) == list(full)[3 * plan.accumulate :]
    assert len(resumed) == len(full) - 3 * plan.accumulate
    assert resumed.state_dict() == state
    assert resumed.state_dict(step=resumed.end_step)["position"] == plan.steps_per_epoch * 12
    # the same commit on one rank of another world size
    three = ElasticSampler(plan.for_world_size(3), 0)
    three.load_state_dict(loaded)
    assert sorted(three.step_indices(3)) == sorted(full.step_indices(3))


def test_set_epoch_restarts_only_a_new_epoch() -> None:
    plan = ElasticPlan(dataset_len=50, global_batch=10, world_size=1, micro_batch=10)
    sampler = ElasticSampler(plan, 0, epoch=1, start_step=2)
    assert sampler.start_position == 20 and len(sampler) == 3
    sampler.set_epoch(1)  # Lightning calls it again at the start of the resumed epoch
    assert (sampler.start_step, len(sampler)) == (2, 3)
    sampler.set_epoch(2)
    assert (sampler.epoch, sampler.start_step, sampler.start_position, len(sampler)) == (2, 0, 0, 5)
    assert sampler.sampler is sampler  # where Lightning's _set_sampler_epoch looks
    assert [i for batch in sampler for i in batch] == epoch_order(50, 0, 2).tolist()


def test_an_iteration_keeps_the_order_it_started_with() -> None:
    plan = ElasticPlan(dataset_len=20, global_batch=5, world_size=1, micro_batch=5)
    sampler = ElasticSampler(plan, 0)
    iterator = iter(sampler)
    first = next(iterator)
    sampler.set_epoch(1)
    rest = list(iterator)
    assert first + [i for batch in rest for i in batch] == epoch_order(20, 0, 0).tolist()


def test_a_finished_epoch_yields_nothing() -> None:
    plan = ElasticPlan(dataset_len=25, global_batch=10, world_size=2, micro_batch=5)
    sampler = ElasticSampler(plan, 1, start_step=2)
    assert (len(sampler), list(sampler), sampler.end_step) == (0, [], 2)
    assert sampler.state_dict()["position"] == 20
    with pytest.raises(ValueError, match="no step is left in epoch 0"):
        sampler.step_indices(2)


def test_a_state_of_another_global_batch_resumes_at_its_position_with_a_warning() -> None:
    old = ElasticSampler(ElasticPlan(dataset_len=100, global_batch=12, world_size=2, micro_batch=6), 0)
    state = old.state_dict(step=2)
    new = ElasticSampler(ElasticPlan(dataset_len=100, global_batch=20, world_size=2, micro_batch=10), 0)
    with pytest.warns(ElasticBatchWarning, match="saved with global_batch=12, the plan has 20"):
        new.load_state_dict(state)
    assert (new.start_step, new.start_position, new.num_steps) == (2, 24, 3)
    assert new.step_indices(2) == epoch_order(100, 0, 0)[24:44].tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2}, r"rank=2 must be an integer in \[0, 1\]"),
        ({"rank": -1}, r"rank=-1 must be an integer in \[0, 1\]"),
        ({"seed": -1}, r"seed=-1 must be an integer >= 0"),
        ({"epoch": True}, r"epoch=True must be an integer >= 0"),
        ({"start_step": -2}, r"start_step=-2 must be an integer >= 0"),
        ({"start_position": 1.5}, r"start_position=1.5 must be an integer >= 0"),
        ({"shuffle": None}, r"shuffle=None must be True or False"),
        ({"plan": {"global_batch": 8}}, r"plan must be an ElasticPlan, got dict"),
    ],
)
def test_bad_sampler_arguments_name_the_argument(kwargs: dict[str, Any], message: str) -> None:
    args = {
        "plan": ElasticPlan(dataset_len=20, global_batch=8, world_size=2, micro_batch=4),
        "rank": 0,
        **kwargs,
    }
    with pytest.raises(ValueError, match=rf"^elastic: {message}"):
        ElasticSampler(**args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position": None}, r"state lacks position; a sampler state holds epoch, step, position"),
        ({"step": True}, r"state\['step'\]=True must be an integer >= 0"),
        ({"seed": -3}, r"state\['seed'\]=-3 must be an integer >= 0"),
        ({"dataset_len": 30}, r"state\['dataset_len'\]=30 differs from plan.dataset_len=20"),
    ],
)
def test_a_bad_state_is_refused(change: dict[str, Any], message: str) -> None:
    sampler = ElasticSampler(ElasticPlan(dataset_len=20, global_batch=8, world_size=2, micro_batch=4), 0)
    state: dict[str, Any] = {**sampler.state_dict(), **change}
    state = {k: v for k, v in state.items() if v is not None}
    with pytest.raises(ValueError, match=rf"^elastic: {message}"):
        sampler.load_state_dict(state)


def test_steps_out_of_range_are_refused() -> None:
    sampler = ElasticSampler(
        ElasticPlan(dataset_len=40, global_batch=8, world_size=2, micro_batch=4), 0, start_step=1
    )
    with pytest.raises(ValueError, match=r"step=0 must be an integer in \[1, 4\]"):
        sampler.step_indices(0)
    with pytest.raises(ValueError, match=r"step=6 must be an integer in \[1, 5\]"):
        sampler.state_dict(step=6)
    with pytest.raises(ValueError, match=r"rank=2 must be an integer in \[0, 1\]"):
        sampler.rank_batches(1, rank=2)
