"""FaultTolerant(reduce_op="adasum"): option checks, the Manager's Adasum over real Gloo groups (threads)
and its failure contract, the lanes of a several-process group (fast); and one fixture of two launches
(slow): a fault-free run and a run whose group 1 is SIGKILLed at step 4.

Both runs are judged against a replay written here without the pack's reduction code (``replay``):
for each committed step, each group's gradient is the mean over the samples it trained in that step
(its micro-batches' gradients, each of a loss over ``M``, times ``M / n``), the groups' gradients are
combined by the pairwise Adasum rule per parameter tensor (``references.adasum_pair``, float64), and
torch's Adam and StepLR step on the result. With 2 groups of 1 process that is what
``DDP(reduce_op="adasum")`` computes with each rank's ``M / 2`` accumulated micro-batches being that
group's (test_ddp_adasum checks DDP against the same pairwise rule). Adasum is not partition-invariant,
so the killed run is not compared with the fault-free run (its steps trained by one group are plain
means): it is compared with the replay of its own committed steps, and the test checks that the two
replays differ, so the comparison would see a step replayed with the wrong partition.
Tolerance: atol 1e-6, rtol 1e-5 (today's FaultTolerant tests'; float32 run against a float64 rule).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ft_harness as ft
import pytest
import torch
from references import adasum_pair
from torch import nn
from torch.futures import Future

pytest.importorskip("torchft", reason="FaultTolerant needs torchft: pip install '.[ft]'")

from lightning_dist.algorithms.micro_batch_slots import group_slots  # noqa: E402
from lightning_dist.collectives import Communicator  # noqa: E402
from lightning_dist.collectives.adasum import adasum_reference  # noqa: E402
from lightning_dist.collectives.fault_tolerant import FaultTolerantTransport, ManagedBackend  # noqa: E402
from lightning_dist.collectives.torch_backend import TorchBackend  # noqa: E402

KILL_STEP = 4
STEPS = 16
GLOBAL_BATCH = 16
MICRO = 4
FP16_ATOL = 2e-4
"""fp16 on the wire against the fp32 replay (16 Adam steps, weights of order 0.4; measured 2.5e-5)."""


# -- fast ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduce_op": "max"}, r"reduce_op='max' is not supported; accepted: 'avg', 'adasum'"),
        ({"reduce_op": "sum"}, r"reduce_op='sum' is not supported"),
        (
            {"reduce_op": "adasum", "compressor": "powersgd"},
            r"compressor='powersgd' with reduce_op='adasum'.*accepted with reduce_op='adasum': "
            r"compressor=None, none, fp16, bf16",
        ),
    ],
)
def test_bad_reduce_op_names_the_argument(kwargs: dict, message: str) -> None:
    from lightning_dist import FaultTolerant

    with pytest.raises(ValueError, match=message):
        FaultTolerant(**kwargs)


def test_reduce_op_spellings_and_dense_compressors_are_taken() -> None:
    from lightning_dist import FaultTolerant, FaultTolerantDiLoCo

    assert FaultTolerant().reduce_op == "avg" and FaultTolerant(reduce_op="mean").reduce_op == "avg"
    assert FaultTolerant(reduce_op="adasum").reduce_op == "adasum"
    built = FaultTolerant(reduce_op="adasum", compressor="fp16").compression
    assert built is not None and built.compressor.name == "fp16"
    with pytest.raises(ValueError, match="unknown option.*reduce_op"):
        FaultTolerantDiLoCo(reduce_op="adasum")  # DiLoCo's sync is its outer step, not a gradient's


@pytest.mark.parametrize(
    ("slots", "participants", "size", "expected"),
    [(4, 2, 1, [2, 2]), (3, 2, 1, [2, 1]), (8, 2, 2, [4, 4]), (6, 2, 2, [4, 2]), (5, 1, 2, [5])],
)
def test_group_slots_count_every_process_of_the_group(
    slots: int, participants: int, size: int, expected: list[int]
) -> None:
    got = [group_slots(slots, participants, size, rank) for rank in range(participants)]
    assert got == expected and sum(got) == slots
    assert group_slots(slots, participants, size, None) == 0


class _StubManager:
    """What ``ManagedBackend`` uses of torchft's ``Manager``: its current process group, its place in
    the quorum and its error record."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.errors: list[Exception] = []
        self._pg = SimpleNamespace(parent=group, getBackendName=lambda: "gloo")
        self.rank, self.world_size = rank, world_size

    def errored(self) -> Any:
        return self.errors[0] if self.errors else None

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def num_participants(self) -> int:
        return self.world_size

    def participating_rank(self) -> int:
        return self.rank


def _gloo(store: Any, prefix: str, rank: int, size: int) -> Any:
    from lightning_dist.collectives.fault_tolerant import bound_gloo_options

    prefixed = torch.distributed.PrefixStore(prefix, store)
    return torch.distributed.ProcessGroupGloo(
        prefixed, rank, size, bound_gloo_options(timedelta(seconds=30), "127.0.0.1")
    )


def _in_threads(n: int, fn: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


def _group_grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen), torch.randn(3, generator=gen)]


@pytest.mark.parametrize("groups", [2, 3])
def test_managed_adasum_over_real_gloo_groups_is_the_reference(groups: int) -> None:
    """``Communicator(ManagedBackend).all_reduce(op="adasum")`` over the Manager's process group: every
    group ends with the same tensors, the Adasum of theirs (``adasum_reference``), and no error."""
    store = torch.distributed.HashStore()

    def group(rank: int) -> tuple[list[torch.Tensor], list[Exception]]:
        manager = _StubManager(_gloo(store, "quorum", rank, groups), rank, groups)
        tensors = _group_grads(rank)
        Communicator(ManagedBackend(manager)).all_reduce(tensors, "adasum")
        return tensors, manager.errors

    results = _in_threads(groups, group)
    expected = adasum_reference([_group_grads(r) for r in range(groups)])
    for tensors, errors in results:
        assert not errors
        for got, want, first in zip(tensors, expected, results[0][0], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            assert torch.equal(got, first), "the groups hold different results"


@pytest.mark.parametrize("compressor", ["none", "fp16"])
def test_a_dense_compressor_adasums_each_tensor_in_its_wire_dtype(compressor: str) -> None:
    """``CompressedGradients(..., adasum=True).reduce`` over the Manager's process group: one Adasum
    per tensor (not of the fused buffer), in the compressor's wire dtype."""
    from lightning_dist.compression import COMPRESSORS
    from lightning_dist.wire.fault_tolerant_compression import CompressedGradients

    store = torch.distributed.HashStore()

    def group(rank: int) -> list[torch.Tensor]:
        comm = Communicator(ManagedBackend(_StubManager(_gloo(store, "quorum", rank, 2), rank, 2)))
        return CompressedGradients(COMPRESSORS[compressor](), adasum=True).reduce(comm, _group_grads(rank))

    results = _in_threads(2, group)
    wire = torch.float16 if compressor == "fp16" else torch.float32
    expected = adasum_reference([[t.to(wire) for t in _group_grads(r)] for r in range(2)])
    tol = 1e-3 if compressor == "fp16" else 1e-6
    for tensors in results:
        for got, want, first in zip(tensors, expected, results[0], strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want.float(), atol=tol, rtol=tol)
            assert torch.equal(got, first)


def test_lanes_of_two_process_groups_give_every_process_the_whole_adasum() -> None:
    """Two groups of two processes (threads): the group's sum, then lane ``r`` Adasums tensors
    ``r, r + 2, ...`` across the groups and a sum in the group hands out the rest; every process ends
    with the Adasum of the two groups' sums, bitwise the same."""
    store = torch.distributed.HashStore()
    inputs = {(g, r): _group_grads(10 * g + r) for g in range(2) for r in range(2)}

    def process(i: int) -> list[torch.Tensor]:
        g, r = divmod(i, 2)
        transport = SimpleNamespace(
            group=Communicator(TorchBackend(_gloo(store, f"group{g}", r, 2))),
            group_rank=r,
            communicator=Communicator(ManagedBackend(_StubManager(_gloo(store, f"lane{r}", g, 2), g, 2))),
        )
        tensors = [t.clone() for t in inputs[(g, r)]]
        for t in tensors:
            transport.group.all_reduce(t, "sum")
        FaultTolerantTransport.adasum_over_groups(transport, tensors)  # type: ignore[arg-type]
        return tensors

    results = _in_threads(4, process)
    sums = [[a + b for a, b in zip(inputs[(g, 0)], inputs[(g, 1)], strict=True)] for g in range(2)]
    expected = adasum_reference(sums)
    for tensors in results:
        for got, want, first in zip(tensors, expected, results[0], strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            assert torch.equal(got, first)


class _DeadPeer:
    """A process group view whose peer has died: every send and receive fails."""

    rank, world_size, device_type, independent_tags = 0, 2, "cpu", False
    calls = 0

    def _failed(self, *args: Any, **kwargs: Any) -> Future:
        self.calls += 1
        fut: Future = Future()
        fut.set_exception(RuntimeError("Connection reset by peer"))
        return fut

    send = recv = _failed


def test_a_peer_failure_in_adasum_marks_the_step_failed_instead_of_raising() -> None:
    """Adasum on a dead peer: reported to the Manager (the step is then not committed), the tensors
    zeros; once the step has failed, a later Adasum sends nothing."""
    dead = _DeadPeer()
    manager = _StubManager(None, 0, 2)
    backend = ManagedBackend(manager)
    backend._current = lambda: dead  # type: ignore[assignment, method-assign, return-value]
    comm = Communicator(backend)
    tensors = [torch.ones(5), torch.ones(3)]
    comm.all_reduce(tensors, "adasum")
    assert len(manager.errors) == 1 and "reset by peer" in str(manager.errors[0])
    assert all(not t.any() for t in tensors)
    calls = dead.calls
    again = [torch.ones(4)]
    comm.all_reduce(again, "adasum")
    assert dead.calls == calls and not again[0].any(), "a collective was sent after the step had failed"


# -- slow: a fault-free run and a SIGKILLed group -----------------------------------------------------
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """tests/scripts/ft_train.py's samples."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def partitions(out: Path, groups: int = 2, ranks: int = 1) -> dict[int, list[list[int]]]:
    """step -> the samples each group trained in it (over its ``ranks`` processes), in participant
    order (the groups that committed it, by replica id)."""
    steps: dict[int, list[list[int]]] = {}
    for group in range(groups):
        trained: dict[int, list[int]] = {}
        for rank in range(ranks):
            for row in ft.rows(out, group, rank):
                trained.setdefault(row["step"], []).extend(row["indices"])
        for step, indices in trained.items():
            steps.setdefault(step, []).append(indices)
    return steps


def replay(steps: dict[int, list[list[int]]]) -> dict[str, torch.Tensor]:
    """The script's Regression trained by Adam (lr 0.01, StepLR 0.97 per step) on the Adasum of the
    groups' mean gradients of each step (module docstring)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = _data()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.97)
    slots = GLOBAL_BATCH // MICRO
    for step in sorted(steps):
        means = []
        for indices in steps[step]:
            net.zero_grad()
            for start in range(0, len(indices), MICRO):
                part = indices[start : start + MICRO]
                (nn.functional.mse_loss(net(x[part]), y[part]) / slots).backward()
            scale = slots / (len(indices) // MICRO)
            means.append([p.grad.detach() * scale for p in net.parameters()])  # type: ignore[union-attr]
        combined = means[0]
        for other in means[1:]:  # two groups at most here
            combined = [adasum_pair(a, b).float() for a, b in zip(combined, other, strict=True)]
        for p, g in zip(net.parameters(), combined, strict=True):
            p.grad = g.clone()
        optimizer.step()
        schedule.step()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def adasum_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three launches at once, reduce_op="adasum": the fault-free run; a run whose group 1 SIGKILLs
    itself at step 4 (cold restart; the survivor slows down until the restart has rejoined, so it
    trains some steps alone and the restart rejoins within the run); 2 groups x 2 processes,
    fault-free (the lanes of ``adasum_over_groups``); and fault-free with fp16 on the wire."""
    base = tmp_path_factory.mktemp("ft_adasum")
    dirs = {name: base / name for name in ("reference", "kill", "groups", "fp16")}
    env = {"FT_REDUCE_OP": "adasum"}
    launches = {
        "reference": ft.launch(dirs["reference"], steps=STEPS, **env),
        "groups": ft.launch(dirs["groups"], steps=STEPS, nproc_per_group=2, **env),
        "fp16": ft.launch(dirs["fp16"], steps=STEPS, FT_COMPRESSOR="fp16", **env),
        "kill": ft.launch(
            dirs["kill"],
            steps=STEPS,
            warm=False,
            FT_FAIL=f"1:{KILL_STEP}",
            FT_SLEEP="2.0",
            FT_AWAIT="1:1",
            **env,
        ),
    }
    try:
        for name, launch in launches.items():
            ft.finish(launch, dirs[name], timeout=240)
    finally:
        from lightning_dist.launch.fault_tolerant import stop_groups

        for launch in launches.values():  # a failed finish leaves the others: end them too
            stop_groups(launch[1])
            launch[0].shutdown()
    return dirs


def _check_samples(out: Path, reference: Path) -> None:
    got, want = ft.steps(out), ft.steps(reference)
    assert sorted(got) == list(range(STEPS))
    for step, indices in got.items():
        assert len(indices) == GLOBAL_BATCH == len(set(indices)), f"step {step}: a sample lost or repeated"
        assert sorted(indices) == sorted(want[step]), f"step {step} trained other samples"


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the fixture's 240 s budget
def test_fault_free_adasum_is_ddp_adasum_of_the_groups_means(adasum_runs: dict) -> None:
    """Two groups, every step: the weights are the replay's (Adasum of the two groups' means, what
    DDP(reduce_op="adasum") computes), and differ from plain averaging."""
    out = adasum_runs["reference"]
    steps = partitions(out)
    assert sorted(steps) == list(range(STEPS)) and all(len(p) == 2 for p in steps.values())
    _check_samples(out, out)
    expected = replay(steps)
    for group in range(2):
        torch.testing.assert_close(ft.weights(out, group), expected, atol=1e-6, rtol=1e-5)
    averaged = replay({s: [sum(p, [])] for s, p in steps.items()})  # one group: the plain mean
    assert max((expected[k] - averaged[k]).abs().max().item() for k in expected) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_sigkilled_group_adasum_follows_its_quorum_history(adasum_runs: dict) -> None:
    """Group 1 dies at step 4; group 0 keeps its process and trains alone for a while; the restart
    rejoins; every step's samples are trained once; both groups end on the replay of the run's own
    committed steps (one group: its mean; two: Adasum), which differs from the fault-free replay."""
    out = adasum_runs["kill"]
    assert [a for a, _ in ft.pids(out, 0)] == [0], "the healthy group's process was restarted"
    assert [a for a, _ in ft.pids(out, 1)] == [0, 1]
    steps = partitions(out)
    alone = [s for s, p in steps.items() if len(p) == 1]
    assert alone and min(alone) == KILL_STEP, "group 0 never trained alone from the killed step"
    assert any(len(steps[s]) == 2 for s in steps if s > max(alone)), "the restart did not rejoin"
    _check_samples(out, adasum_runs["reference"])
    expected = replay(steps)
    for group in range(2):
        torch.testing.assert_close(ft.weights(out, group), expected, atol=1e-6, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(ft.weights(out, 0).values(), ft.weights(out, 1).values()))
    fault_free = replay(partitions(adasum_runs["reference"]))
    assert max((expected[k] - fault_free[k]).abs().max().item() for k in expected) > 1e-4, (
        "the quorum history changed nothing: the comparison above would not see a wrong partition"
    )


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_two_processes_per_group_adasum_the_groups_sums(adasum_runs: dict) -> None:
    """2 groups x 2 processes: each group's gradient is its two processes' slots' sum (made its mean),
    the groups' are combined by Adasum lane by lane, and all four processes end bitwise equal, on the
    replay of the run's partition (a group's slots are its processes': another partition than with
    one process per group)."""
    out = adasum_runs["groups"]
    steps = partitions(out, ranks=2)
    assert sorted(steps) == list(range(STEPS)) and all(len(p) == 2 for p in steps.values())
    expected = replay(steps)
    first = ft.weights(out, 0)
    for group in range(2):
        for rank in range(2):
            got = ft.weights(out, group, rank)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
            assert all(torch.equal(a, b) for a, b in zip(first.values(), got.values())), (group, rank)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_fp16_adasum_is_the_replay_within_its_rounding(adasum_runs: dict) -> None:
    """``compressor="fp16"`` with ``reduce_op="adasum"``: the groups' means cross in fp16 and are
    combined per tensor; the weights are the (fp32) replay's within fp16's rounding, and not the
    fp32 run's bitwise (the wire was fp16)."""
    out = adasum_runs["fp16"]
    expected = replay(partitions(out))
    got = ft.weights(out, 0)
    torch.testing.assert_close(got, expected, atol=FP16_ATOL, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(got.values(), ft.weights(out, 1).values()))
    fp32 = ft.weights(adasum_runs["reference"], 0)
    assert any(not torch.equal(got[k], fp32[k]) for k in got), "the fp16 wire changed nothing"
