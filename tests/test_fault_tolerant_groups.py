"""FaultTolerant with replica groups of several processes (torchrun --nproc-per-node=G, one node = one
group): slot ownership over (group, process) pairs and the option checks (fast); and 2 groups x 2
processes on CPU/Gloo (slow): fault-free, and with one process of group 1 SIGKILLed at step 4.

Tolerance of the weights: atol 1e-6, rtol 1e-5, as tests/test_fault_tolerant.py: against the 2 groups x
1 process fault-free run the step's gradient is the same sum of the same micro-batch gradients, added in
another grouping (within each group first, then across the groups, per shard), so float32 rounding
differs by an ulp or so a step and Adam carries that on.
"""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any

import ft_harness as ft
import pytest

pytest.importorskip("torchft", reason="FaultTolerant needs torchft: pip install '.[ft]'")

from lightning_dist.launch.fault_tolerant import group_command, stop_groups  # noqa: E402

STEPS = 12
"""Steps of each run here (the 30 of tests/test_fault_tolerant.py's runs are not needed)."""
BUDGET = 240
"""Seconds for the fixture's three launches: at most half the tests' 500 s timeout."""


# -- fast ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("participants", "group_size"), [(1, 2), (2, 2), (3, 2), (2, 3), (1, 4)])
def test_every_sample_of_a_step_has_one_owner_over_groups_and_processes(
    participants: int, group_size: int
) -> None:
    """Slot j belongs to process ``p x G + g`` (participant p, process g) of ``participants x G``:
    every sample of the step is taken once, whoever is alive, and each process's share is its
    slots."""
    from lightning_dist import FaultTolerant
    from lightning_dist.elastic.sampler import ElasticPlan

    strategy = FaultTolerant()
    strategy.plan = ElasticPlan(dataset_len=200, global_batch=24, world_size=1, micro_batch=2)
    strategy._participants, strategy._group_size = participants, group_size
    for step in (0, 7, 8, 19):  # 8 steps an epoch
        expected = strategy._sampler(step // 8).step_indices(step % 8)
        taken: list[int] = []
        for rank in range(participants):
            for g in range(group_size):
                strategy._rank, strategy._group_rank = rank, g
                mine = [s for s in range(strategy.slots_per_step) if strategy.owns(s)]
                assert mine == list(
                    range(rank * group_size + g, strategy.slots_per_step, participants * group_size)
                )
                taken += [i for s in mine for i in strategy.slot_indices(step, s)]
        assert sorted(taken) == sorted(expected) and len(set(taken)) == 24
    strategy._rank = None
    assert not any(strategy.owns(s) for s in range(strategy.slots_per_step))


def test_lightning_ranks_are_the_group_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process 1 of a group is Lightning's rank 1 of 2: it writes no checkpoints or logs."""
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_dist import FaultTolerant

    strategy = FaultTolerant()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))  # put back after
    monkeypatch.setattr(SingleDeviceStrategy, "setup_environment", lambda self: None)  # no accelerator
    strategy.setup_environment()
    assert (strategy.global_rank, strategy.world_size, strategy.is_global_zero) == (1, 2, False)
    assert getattr(rank_zero_only, "rank", None) == 1  # Lightning's loggers write on rank 0 only


@pytest.mark.parametrize(("rank", "world"), [("2", "2"), ("-1", "2"), ("0", "0")])
def test_a_rank_outside_the_group_names_the_variables(
    monkeypatch: pytest.MonkeyPatch, rank: str, world: str
) -> None:
    from lightning_dist.strategies.fault_tolerant import group_place

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match="RANK.*WORLD_SIZE"):
        group_place()


def test_diloco_refuses_several_processes_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dist import FaultTolerantDiLoCo

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="FaultTolerantDiLoCo: WORLD_SIZE=2.*accepted: WORLD_SIZE=1"):
        FaultTolerantDiLoCo(inner_steps=2).setup_environment()


def test_launchers_start_g_processes_per_group() -> None:
    from lightning_dist.launch.fault_tolerant import main
    from lightning_dist.launch.slurm import SlurmJob

    assert "--nproc-per-node=4" in group_command(["train.py"], nproc_per_group=4, warm=True)
    assert "--nproc-per-node=1" in group_command(["train.py"])
    with pytest.raises(ValueError, match="nproc_per_group"):
        group_command(["train.py"], nproc_per_group=0)
    with pytest.raises(SystemExit):
        main(["--nproc-per-group", "0", "--", "train.py"])
    script = SlurmJob(["python", "train.py"], nodes=2, devices=4, strategy="ld_fault_tolerant").render()
    assert "#SBATCH --ntasks-per-node=1" in script.splitlines()  # one group (a torchrun) per node
    assert "--host auto --nproc-per-group 4 --max-restarts 3 --" in script
    assert "#SBATCH --cpus-per-task=4" in script.splitlines()  # the node's task runs the 4 processes
    with pytest.raises(ValueError, match="--devices=2.*accepted: --devices 1"):
        SlurmJob(["python", "train.py"], nodes=2, devices=2, strategy="ld_fault_tolerant_diloco")


def test_a_replica_groups_own_process_group_listens_on_host_and_clears_old_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``replica_group`` on torchrun's store (two ranks as threads): its Gloo connections listen on
    ``host`` only, its sum covers both ranks, and torchft's keys of an earlier attempt are gone before
    a Manager could read them (a restarted rank 1 would otherwise join the dead rank 0's server)."""
    import threading
    from datetime import timedelta

    import torch

    from lightning_dist.collectives.fault_tolerant import replica_group

    host = ft.routable_address()
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("manager_addr", "http://dead:1")  # the previous attempt's
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    before = ft.own_listeners()
    sums, keys, groups = [0.0, 0.0], [True, True], [None, None]

    def rank(r: int) -> None:
        group, groups[r] = replica_group(r, 2, "cpu", timedelta(seconds=20), host)  # kept: its sockets
        keys[r] = store.check(["manager_addr"])  # after the group's first barrier
        sums[r] = float(group.all_reduce(torch.tensor([float(r + 1)]), "sum").item())
        group.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sums == [3.0, 3.0] and keys == [False, False]
    gloo = ft.own_listeners() - before
    wanted = socket.inet_aton(host)[::-1].hex().upper()  # /proc/net/tcp's little-endian hex
    assert gloo and {addr for addr, _ in gloo} == {wanted}, gloo
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        replica_group(0, 2, "cpu", timedelta(seconds=1), host)


class _Quorum:
    """What ``check_group_size`` reads of a quorum, and a Manager whose all-reduce adds the other
    groups' ``[processes, 1]`` (as their lane's rank would)."""

    def __init__(self, quorum_id: int, others: list[int], error: bool = False) -> None:
        self.quorum_id, self.others, self.error, self.calls = quorum_id, others, error, 0

    def participating_rank(self) -> int:
        return 0

    def errored(self) -> Any:
        return "failed" if self.error else None

    def allreduce(self, tensor: Any, reduce_op: Any) -> Any:
        import torch

        self.calls += 1
        for size in self.others:
            tensor += torch.tensor([float(size), 1.0])
        return self

    def wait(self) -> None:
        return None


@pytest.mark.parametrize(
    ("mine", "others", "refused"), [(2, [2], False), (2, [2, 2], False), (2, [1], True), (1, [2], True)]
)
def test_groups_of_different_sizes_are_refused_naming_the_option(
    mine: int, others: list[int], refused: bool
) -> None:
    """Each new quorum's first step sums (processes, 1) over the groups on every lane: a group of
    another size than this one's is a ``ValueError`` naming --nproc-per-node; the check runs once per
    quorum, and not in a step that has already failed."""
    from types import SimpleNamespace

    from lightning_dist.collectives.fault_tolerant import FaultTolerantTransport

    fake = _Quorum(7, others)
    transport = object.__new__(FaultTolerantTransport)
    transport.manager, transport.group_size, transport._checked_quorum = fake, mine, None
    transport._quorums = SimpleNamespace(last=fake)  # type: ignore[assignment]
    if refused:
        with pytest.raises(ValueError, match="--nproc-per-node"):
            transport.check_group_size()
    else:
        transport.check_group_size()
        transport.check_group_size()  # the same quorum: not again
    assert fake.calls == 1
    failed = _Quorum(8, others, error=True)
    transport.manager = failed
    transport._quorums = SimpleNamespace(last=failed)  # type: ignore[assignment]
    transport.check_group_size()
    assert failed.calls == 0


# -- slow: whole runs ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three launches at once, 12 steps each: the 2 groups x 1 process reference (cold); 2 groups x 2
    processes fault-free, through the one-box launcher's command line (``--nproc-per-group 2``, warm
    standbys forking both workers); and 2 x 2 where process 1 of group 1 SIGKILLs itself at step 4
    (warm: torchrun restarts both of group 1's processes; group 0 trains alone, slowed down, until
    they are back). Wall times in ``"seconds"``."""
    base = tmp_path_factory.mktemp("ft_groups")
    dirs = {name: base / name for name in ("reference", "groups", "kill")}
    start = time.monotonic()
    launches = {
        "reference": ft.launch(dirs["reference"], steps=STEPS, warm=False),
        "kill": ft.launch(
            dirs["kill"], steps=STEPS, nproc_per_group=2, FT_FAIL="1:4:1", FT_SLEEP="0.5", FT_AWAIT="1:1"
        ),
    }
    groups = ft.start_launcher(
        dirs["groups"], "--groups", "2", "--nproc-per-group", "2", "--max-restarts", "0",
        "--heartbeat-timeout-ms", "1000", FT_STEPS=str(STEPS),
    )  # fmt: skip
    seconds: dict[str, float] = {}
    try:
        try:
            code = groups.wait(timeout=BUDGET)
        except subprocess.TimeoutExpired:
            code = None
        seconds["groups"] = time.monotonic() - start
        log = (dirs["groups"] / "log.txt").read_text()[-6000:]
        assert code == 0, f"the launcher's run ended with {code}; log:\n{log}"
        for name in ("reference", "kill"):
            ft.finish(launches[name], dirs[name], timeout=max(1.0, BUDGET - (time.monotonic() - start)))
            seconds[name] = time.monotonic() - start
    finally:
        ft.end_launcher(groups)
        for launch in launches.values():
            stop_groups(launch[1])
            launch[0].shutdown()
    print(f"ft groups runs (s since the start): {seconds}")
    return {**dirs, "seconds": seconds}


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_two_processes_per_group_end_on_the_one_process_groups_weights(runs: dict) -> None:
    """2 groups x 2 processes: every process trains its own slots (a quarter of each step's), every
    step's global batch once, and all four end on the 2 x 1 run's weights, bitwise equal to each other."""
    out = runs["groups"]
    for group in (0, 1):
        for rank in (0, 1):
            assert [a for a, _ in ft.pids(out, group, rank)] == [0]
            rows = ft.rows(out, group, rank)
            assert [r["step"] for r in rows] == list(range(STEPS))
            assert all(len(r["indices"]) == ft.GLOBAL_BATCH // 4 and r["participants"] == 2 for r in rows)
    ft.check_against_reference(runs["reference"], out, n_steps=STEPS, ranks=2)
    ft.check_hooks(out, ranks=2, exact=True)  # each process's hooks: its own batches, with their steps
    assert not ft.noisy_lines(out), ft.noisy_lines(out)[:5]


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_killed_process_restarts_only_its_group_which_recovers_from_its_peer(runs: dict) -> None:
    """Process 1 of group 1 SIGKILLed at step 4: group 0's two processes are never restarted (same
    PIDs) and train the whole step between them while group 1 is away; group 1's torchrun restarts
    both of its processes, each fetches the state of the same process of group 0, and they rejoin at
    the quorum's step. Every step's samples once; all four end on the fault-free weights."""
    out = runs["kill"]
    for rank in (0, 1):
        assert len(ft.pids(out, 0, rank)) == 1, f"group 0's process {rank} was restarted"
        attempts = ft.pids(out, 1, rank)
        assert [a for a, _ in attempts] == [0, 1] and len({pid for _, pid in attempts}) == 2, (
            f"group 1's process {rank}: {attempts}"
        )
        first, back = ([r["step"] for r in ft.rows(out, 1, rank) if r["attempt"] == a] for a in (0, 1))
        assert first == [0, 1, 2, 3] and back and back[0] > 4, "group 1 did not rejoin at a later step"
        alone = [r for r in ft.rows(out, 0, rank) if r["participants"] == 1]
        assert alone and all(len(r["indices"]) == ft.GLOBAL_BATCH // 2 for r in alone), (
            "group 0's processes did not take over group 1's slots"
        )
    ft.check_against_reference(runs["reference"], out, n_steps=STEPS, ranks=2)
    ft.check_hooks(out, ranks=2)
