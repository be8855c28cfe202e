"""FaultTolerant (live recovery on torchft): option checks, the received-state checks and the checkpoint
server's listen address (fast); and SIGKILLed replica groups on CPU/Gloo (slow): the other group keeps
its process, the killed one is restarted by its torchrun and recovers from its peer, every step's
global batch is trained exactly once, and the final weights equal the fault-free run's.

Tolerance of the weights: atol 1e-6, rtol 1e-5 (measured: at most 3e-8 after 30 Adam steps). While a
group is missing, the survivor sums all of a step's micro-batch gradients itself instead of adding two
groups' partial sums: the same terms in another order, so float32 rounding differs by an ulp or so a
step, and Adam's update carries that on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ft_harness as ft
import lightning as L
import pytest
import torch
from helpers import child_env

pytest.importorskip("torchft", reason="FaultTolerant needs torchft: pip install '.[ft]'")

from lightning_dist.collectives.fault_tolerant import (  # noqa: E402
    _bound_gloo_group,
    _safe_http_transport,
    checked_state,
    stamp_state,
    state_checksum,
)
from lightning_dist.launch.fault_tolerant import Lighthouse, start_groups, stop_groups  # noqa: E402

SCRIPT, STEPS, GLOBAL_BATCH = ft.SCRIPT, ft.STEPS, ft.GLOBAL_BATCH


# -- fast ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"replica_groups": 0}, "replica_groups"),
        ({"min_replica_size": 3}, "min_replica_size"),
        ({"global_batch": 0}, "global_batch"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"start_groups": 5}, "start_groups"),
    ],
)
def test_bad_options_name_the_argument(kwargs: dict, named: str) -> None:
    from lightning_dist import FaultTolerant

    with pytest.raises(ValueError, match=named):
        FaultTolerant(**kwargs)


def test_registered_name_builds_the_strategy() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dist import FaultTolerant

    assert StrategyRegistry["ld_fault_tolerant"]["strategy"] is FaultTolerant


@pytest.mark.parametrize("participants", [1, 2, 3])
def test_every_sample_of_a_step_has_one_owner_whoever_is_alive(participants: int) -> None:
    from lightning_dist import FaultTolerant
    from lightning_dist.elastic.sampler import ElasticPlan
    from lightning_dist.strategies.fault_tolerant import owns_slot

    strategy = FaultTolerant()
    strategy.plan = ElasticPlan(dataset_len=100, global_batch=12, world_size=1, micro_batch=2)
    for step in (0, 7, 8, 20):  # 8 steps an epoch: 8 and 20 are in later epochs
        expected = strategy._sampler(step // 8).step_indices(step % 8)
        taken = [
            i
            for rank in range(participants)
            for slot in range(strategy.slots_per_step)
            if owns_slot(slot, participants, rank)
            for i in strategy.slot_indices(step, slot)
        ]
        assert sorted(taken) == sorted(expected) and len(set(taken)) == 12
    assert not owns_slot(0, 2, None)


def _state() -> dict:
    model = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    return {"model": model, "optimizers": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}]}


def test_checked_state_accepts_a_good_state() -> None:
    state = _state()
    got = checked_state(stamp_state(state, 7), 7, state["model"])
    assert torch.equal(got["model"]["w"], state["model"]["w"])


@pytest.mark.parametrize("defect", ["step", "checksum", "shape", "dtype", "missing"])
def test_checked_state_refuses_a_bad_state(defect: str) -> None:
    state = _state()
    received = stamp_state(state, 7)
    like = dict(state["model"])
    step = 7
    if defect == "step":
        step = 8
    elif defect == "checksum":
        received["state"]["model"]["w"][0, 0] = 99.0  # changed after it was stamped
    elif defect == "shape":
        like["w"] = torch.zeros(3, 2)
    elif defect == "dtype":
        like["b"] = torch.zeros(3, dtype=torch.float64)
    else:
        like["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match="FaultTolerant"):
        checked_state(received, step, like)


def test_checksum_covers_every_tensor() -> None:
    a, b = _state(), _state()
    assert state_checksum(a) == state_checksum(b)
    b["optimizers"][0]["state"][0]["step"] += 1
    assert state_checksum(a) != state_checksum(b)


def test_checkpoint_server_listens_on_the_given_host_and_loads_weights_only() -> None:
    transport = _safe_http_transport(timedelta(seconds=10), "127.0.0.1")
    try:
        port = transport._server.socket.getsockname()[1]
        assert ft.listening(port) == ["0100007F"]  # not every interface (torchft's default)
        assert transport.metadata() == f"http://127.0.0.1:{port}/checkpoint/"
        state = stamp_state(_state(), 3)
        transport.send_checkpoint([1], 3, state, timedelta(seconds=10))
        got = transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=10))
        assert state_checksum(got["state"]) == state["checksum"]
        # anything weights_only cannot load is refused, not unpickled
        transport.send_checkpoint([1], 4, {"x": socket.socket}, timedelta(seconds=10))
        with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
            transport.recv_checkpoint(0, transport.metadata(), 4, timedelta(seconds=10))
    finally:
        transport.shutdown(wait=True)


def test_checkpoint_server_stops_without_waiting_and_leaves_nothing_polling() -> None:
    """``shutdown(wait=False)`` (what the Manager calls) ends the server's loop and closes its socket
    (torchft's sets a flag its server never reads: the loop polled on, a core's worth once the
    socket was closed)."""
    transport = _safe_http_transport(timedelta(seconds=10), "127.0.0.1")
    port = transport._server.socket.getsockname()[1]
    transport.shutdown(wait=False)
    transport._thread.join(5)
    assert not transport._thread.is_alive()
    assert ft.listening(port) == []


def test_gloo_connections_listen_on_the_given_host_only() -> None:
    """The reconfigurable Gloo group's sockets listen on ``host``, not on the host name's address
    (torch's default device): two ranks as threads, configured as torchft's Manager configures them."""
    host = ft.routable_address()
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    before = ft.own_listeners()
    groups = [_bound_gloo_group(timedelta(seconds=20), host) for _ in range(2)]
    sums: list[float] = [0.0, 0.0]

    def rank(r: int) -> None:
        groups[r].configure(f"127.0.0.1:{store.port}/gloo_bind", f"replica_{r}", r, 2, quorum_id=1)
        t = torch.tensor([float(r + 1)])
        groups[r].allreduce([t], torch.distributed.AllreduceOptions()).wait()
        sums[r] = float(t.item())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sums == [3.0, 3.0]
    gloo = ft.own_listeners() - before
    wanted = socket.inet_aton(host)[::-1].hex().upper()  # /proc/net/tcp's little-endian hex
    assert gloo and {addr for addr, _ in gloo} == {wanted}, gloo


def test_lighthouse_listens_on_the_given_host_only() -> None:
    with Lighthouse("127.0.0.1:0") as lighthouse:
        assert lighthouse.address.startswith("http://127.0.0.1:")
        port = int(lighthouse.bind.rsplit(":", 1)[1])
        assert ft.listening(port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 or [::]


def test_slurm_script_starts_a_lighthouse_and_one_warm_group_per_node() -> None:
    from lightning_dist.launch.slurm import SlurmJob

    script = SlurmJob(["python", "train.py", "--x", "a b"], nodes=4, strategy="ld_fault_tolerant").render()
    lines = script.splitlines()
    assert "#SBATCH --ntasks-per-node=1" in lines and "#SBATCH --signal=B:SIGUSR1@90" in lines
    assert "lighthouse_addr=$(getent ahostsv4 \"$head\" | awk '{print $1; exit}')" in lines
    lighthouse = next(line for line in lines if line.startswith("torchft_lighthouse "))
    assert '--bind "$lighthouse_addr:$port"' in lighthouse and lighthouse.endswith("&")  # not every interface
    assert "trap 'kill \"$lighthouse\" 2>/dev/null || true' EXIT" in lines
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script  # the requeued job resumes from its commits
    launch = next(line for line in lines if line.startswith("srun "))
    assert launch == (
        "srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c 'exec python -m "
        'lightning_dist.launch.fault_tolerant --group "$SLURM_NODEID" --lighthouse "$0" --host auto '
        '--max-restarts 3 -- "$@"\' "http://$lighthouse_addr:$port" train.py --x \'a b\' &'
    )
    named = SlurmJob(["python", "-m", "pkg.train"], nodes=2, strategy="FaultTolerant", master_addr="10.0.0.1")
    assert (
        "lighthouse_addr=10.0.0.1" in named.render()
        and '-- "$@"\' "http://$lighthouse_addr:$port" -m pkg.train' in named.render()
    )
    # --devices G: G processes per group (tests/test_fault_tolerant_groups.py); DiLoCo's groups are one
    assert (
        "--nproc-per-group 2 "
        in SlurmJob(["python", "train.py"], nodes=2, devices=2, strategy="ld_fault_tolerant").render()
    )
    with pytest.raises(ValueError, match="--devices=2"):
        SlurmJob(["python", "train.py"], nodes=2, devices=2, strategy="ld_fault_tolerant_diloco")
    with pytest.raises(ValueError, match="python script.py"):
        SlurmJob(["python", "-u", "train.py"], nodes=2, strategy="ld_fault_tolerant").render()


def test_launcher_options_for_one_group_of_a_cluster() -> None:
    from lightning_dist.launch.fault_tolerant import address_towards, main

    assert address_towards("http://127.0.0.1:29510") == "127.0.0.1"
    with pytest.raises(SystemExit):  # --group without the job's Lighthouse
        main(["--group", "1", "--", "train.py"])
    with pytest.raises(ValueError, match="--lighthouse"):
        address_towards("http://")


# -- fast: what a user meets (construction checks, the devices, the resume line, the hooks, the logs) --
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lighthouse": 123}, TypeError, r"lighthouse=123; accepted: a str 'http://host:port'"),
        (
            {"lighthouse": "localhost:29510"},
            ValueError,
            r"lighthouse='localhost:29510'; accepted: 'http://host:port'",
        ),
        ({"lighthouse": "http://127.0.0.1"}, ValueError, "lighthouse='http://127.0.0.1'"),
        ({"lighthouse": "ftp://127.0.0.1:21"}, ValueError, "lighthouse='ftp"),
        ({"lighthouse": "http://127.0.0.1:29510/x"}, ValueError, "lighthouse="),
        ({"replica_id": 7.5}, TypeError, r"replica_id=7.5; accepted: None, an int or a str"),
        ({"replica_id": True}, TypeError, "replica_id=True"),
        ({"replica_id": ""}, ValueError, "replica_id=''"),
        ({"replica_id": "a:b"}, ValueError, "replica_id='a:b'.*without ':'"),
        ({"replica_id": -1}, ValueError, "replica_id=-1"),
        ({"host": ""}, ValueError, r"host=''; accepted"),
        ({"host": 5}, TypeError, "host=5"),
        ({"host": "http://10.0.0.1"}, ValueError, "host='http://10.0.0.1'"),
        ({"verbose": "yes"}, ValueError, "verbose='yes' must be True or False"),
    ],
)
def test_addresses_and_ids_are_checked_at_construction(kwargs: dict, error: type, match: str) -> None:
    """Refused by ``FaultTolerant(...)`` itself, naming the argument and the accepted form (before:
    TypeErrors from deep inside torchft at setup, or ``host=''`` silently replaced)."""
    from lightning_dist import FaultTolerant, FaultTolerantDiLoCo

    with pytest.raises(error, match=match):
        FaultTolerant(**kwargs)
    with pytest.raises(error, match=match):
        FaultTolerantDiLoCo(inner_steps=2, **kwargs)


def test_good_addresses_and_an_int_replica_id_are_taken() -> None:
    from lightning_dist import FaultTolerant

    strategy = FaultTolerant(lighthouse="https://head.example:29510/", replica_id=7, host="::1")
    assert strategy.options.replica_id == "7"  # torchft takes a str (an int raised a TypeError in it)
    assert FaultTolerant(replica_id="group0", host="node1").options.replica_id == "group0"


def _fit_alone(
    root: Path, lighthouse: Any, callbacks: Any = (), devices: Any = "auto", **kwargs: Any
) -> tuple[Any, Any]:
    """A one-group FaultTolerant fit in this process (``FaultTolerant(**kwargs)``; 2 steps of 4
    micro-batches of 4, Adam, a per-step schedule, a commit every step), writing under ``root``;
    returns (trainer, module)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dist import FaultTolerant
    from lightning_dist.workload.trainer import quiet_trainer

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)
            self.losses: list[tuple[list[int], torch.Tensor]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, index = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append((index.tolist(), loss.detach().clone()))
            return loss

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(64))
    options = {"replica_groups": 1, "global_batch": 16, "commit_every": 1, **kwargs}
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=devices,
        strategy=FaultTolerant(lighthouse=lighthouse, **options),
        max_steps=2,
        default_root_dir=root,
        callbacks=list(callbacks),
    )
    module = Module()
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer, module


class _UserHooks(L.Callback):
    """A user's callback reading the batch in ``on_train_batch_start`` and the outputs of its
    ``training_step`` in ``on_train_batch_end`` (each batch's loss over the step's 4 micro-batches,
    as Lightning's own accumulation of 4 gives it)."""

    def __init__(self) -> None:
        self.ended: list[list[int]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        x, y, index = batch
        assert x.shape == (4, 4) and index.shape == (4,)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trained, loss = pl_module.losses[-1]
        assert trained == batch[2].tolist() and len(pl_module.losses) == len(self.ended) + 1
        assert torch.equal(outputs["loss"], loss / 4)
        self.ended.append(trained)


def test_hooks_see_the_batches_this_group_trains_and_a_second_run_says_it_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One group in this process: the batch hooks fire with each ``training_step`` on its real batch
    and outputs (before: on ``Slot`` tokens), torchft logs nothing at INFO and no "NCCL flight
    recorder" warning; the commits go under the Trainer's ``default_root_dir``; the same fit run
    again resumes from them and says so, with the step, the commit and why it stops at once."""
    import logging

    caplog.set_level(logging.INFO)
    with Lighthouse("127.0.0.1:0") as lighthouse:
        hooks = _UserHooks()
        trainer, module = _fit_alone(tmp_path, lighthouse.address, [hooks])
        assert [i for i, _ in module.losses] == hooks.ended and len(hooks.ended) == 8  # 2 steps x 4
        assert sorted(i for r in trainer.strategy.committed for i in r.indices) == sorted(
            i for batch in hooks.ended for i in batch
        )
        torchft = [r for r in caplog.records if r.name.startswith("torchft")]
        assert not [r for r in torchft if r.levelno < logging.WARNING], torchft[:3]
        assert not [r for r in caplog.records if "flight recorder" in r.getMessage()]
        assert (tmp_path / "ft_commits").is_dir()  # <default_root_dir>/ft_commits
        caplog.clear()
        again, module = _fit_alone(tmp_path, lighthouse.address)
    assert again.strategy.resumed_from == 2 and module.losses == [] and again.global_step == 2
    said = [r.getMessage() for r in caplog.records if "resumed from the commit" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].startswith("FaultTolerant: resumed from the commit of step 2 (")
    assert str(tmp_path / "ft_commits") in said[0] and "max_steps=2) is reached" in said[0]


def test_trainer_devices_other_than_the_groups_processes_are_refused(tmp_path: Path) -> None:
    """``Trainer(devices=2)`` with one process per group is refused before training, naming
    ``--nproc-per-group`` (before: it trained at world size 1 without a word); the group's own
    process count is accepted."""
    from lightning_dist import FaultTolerant

    refused = r"Trainer\(devices=2\).*1 process.*--nproc-per-group 2"
    with Lighthouse("127.0.0.1:0") as lighthouse, pytest.raises(ValueError, match=refused):
        _fit_alone(tmp_path, lighthouse.address, devices=2)

    strategy = FaultTolerant()
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    strategy.check_devices(2)  # a group of 2 processes (torchrun --nproc-per-node=2)
    with pytest.raises(ValueError, match="devices=2"):
        strategy.check_devices(3)


def test_an_unreachable_lighthouse_fails_within_timeout_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing listening at the address: the fit's setup fails after timeout_s, naming the address
    (before: torchft retried for a minute and more); a host that does not resolve fails at once; a
    ``$TORCHFT_LIGHTHOUSE`` of another form is refused naming the variable."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no Lighthouse answers at {closed}.*timeout_s=1"):
        _fit_alone(tmp_path, closed, timeout_s=1)
    assert time.monotonic() - start < 15
    with pytest.raises(ConnectionError, match="does not resolve"):
        _fit_alone(tmp_path, "http://no-such-host.invalid:29510", timeout_s=30)
    assert time.monotonic() - start < 45
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "127.0.0.1:29510")
    with pytest.raises(
        ValueError, match=r"\$TORCHFT_LIGHTHOUSE='127.0.0.1:29510'; accepted: 'http://host:port'"
    ):
        _fit_alone(tmp_path, None)  # type: ignore[arg-type]


@pytest.fixture
def torchft_log_levels() -> Any:
    """torchft's logger levels and filters put back after the test."""
    import logging

    from lightning_dist.collectives.fault_tolerant_logs import TORCHFT_LOGGERS

    saved = {name: logging.getLogger(name).level for name in TORCHFT_LOGGERS}
    filters = list(logging.getLogger("torchft.manager").filters)
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger("torchft.manager").filters[:] = filters


def test_one_switch_turns_torchft_logs_on(monkeypatch: pytest.MonkeyPatch, torchft_log_levels: Any) -> None:
    """Quiet by default: torchft's Python loggers at WARNING and its servers' ``RUST_LOG=warn`` in each
    group's environment; ``FaultTolerant(verbose=True)`` or ``LD_FT_VERBOSE=1`` (the launcher's
    ``--verbose``) turns them on; a ``RUST_LOG`` the user set is kept."""
    import logging

    from lightning_dist import FaultTolerant
    from lightning_dist.launch.fault_tolerant import group_env

    monkeypatch.delenv("LD_FT_VERBOSE", raising=False)
    monkeypatch.delenv("RUST_LOG", raising=False)
    FaultTolerant()
    assert logging.getLogger("torchft.manager").getEffectiveLevel() == logging.WARNING
    assert group_env(0, "http://127.0.0.1:1", env={})["RUST_LOG"] == "warn"
    assert group_env(0, "http://127.0.0.1:1", env={"RUST_LOG": "debug"})["RUST_LOG"] == "debug"
    assert "RUST_LOG" not in group_env(0, "http://127.0.0.1:1", env={"LD_FT_VERBOSE": "1"})
    FaultTolerant(verbose=True)
    assert logging.getLogger("torchft.manager").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("torchft_quorums").getEffectiveLevel() == logging.INFO
    logging.getLogger("torchft").setLevel(logging.NOTSET)
    monkeypatch.setenv("LD_FT_VERBOSE", "1")
    assert FaultTolerant().verbose and not FaultTolerant(verbose=False).verbose


# -- slow: whole runs ----------------------------------------------------------------------------------
def _stop_then_restart_lighthouse(out: Path, lighthouse: Lighthouse, events: dict[str, float]) -> None:
    """During the run in ``out``: SIGSTOP group 1's worker for 15 s (past timeout_s=10) once group 0
    has committed 6 steps, then, once both train together again, stop the Lighthouse for 2 s and
    start it again on the same address."""
    deadline = time.monotonic() + 200
    while len(ft.rows(out, 0)) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = ft.pids(out, 1)[-1][1]  # our child's worker, by PID
    os.kill(worker, signal.SIGSTOP)
    events["stopped_at_step"] = len(ft.rows(out, 0))
    time.sleep(15)
    os.kill(worker, signal.SIGCONT)
    while time.monotonic() < deadline:
        rows = ft.rows(out, 0)
        if rows and rows[-1]["participants"] == 2 and rows[-1]["step"] > events["stopped_at_step"]:
            break
        time.sleep(0.05)
    events["lighthouse_down_at_step"] = len(ft.rows(out, 0))
    lighthouse.shutdown()
    time.sleep(2)
    lighthouse.restart()


def _kill_the_job_and_start_it_again(first: Path, again: Path, launch: Any, started: dict[str, Any]) -> None:
    """Once the run in ``first`` has committed 17 steps (a commit at 10), end both its groups (the
    whole job dies), then start the job again writing to ``again``, on ``first``'s commits."""
    deadline = time.monotonic() + 200
    while len(ft.rows(first, 0)) < 17 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_groups(launch[1])
    launch[0].shutdown()
    started["again"] = ft.launch(again, FT_COMMITS=str(first / "ft_commits"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Five launches at once: the fault-free run (``python -m lightning_dist.launch.fault_tolerant
    --cold``: no standby); a run where group 1's worker SIGKILLs itself at step 4 (torchft's
    ``fail_at``) and its first restart SIGKILLs itself again while it applies its peer's state; a
    run where group 1 is SIGSTOPped past the timeout, then the Lighthouse is stopped and started
    again; a run whose whole job is ended at step 17 and started again; and a run of 3 replica
    groups where group 1's worker SIGKILLs itself at step 4 and its restart waits 4 s before it
    starts. The kill run restarts cold (a fresh Python, 10-30 s here, so group 0 trains alone for
    a while), the others warm (a standby per group forks the worker torchrun restarts: about a
    second, so the 3-group run's restart pauses to leave the two others steps of their own)."""
    base = tmp_path_factory.mktemp("ft_runs")
    dirs = {name: base / name for name in ("reference", "kill", "stop", "whole", "whole_again", "three")}
    events: dict[str, float] = {}
    launches = {
        "kill": ft.launch(
            dirs["kill"], warm=False, FT_FAIL="1:4", FT_SLEEP="1.0", FT_AWAIT="1:2", FT_KILL_IN_RECOVERY="1"
        ),
        "stop": ft.launch(dirs["stop"], FT_PAUSE="0.1", FT_SLEEP="0.5", FT_AWAIT="1:0"),
        "whole": ft.launch(dirs["whole"], FT_PAUSE="0.1"),
        "three": ft.launch(
            dirs["three"], groups=3, FT_FAIL="1:4", FT_SLEEP="0.5", FT_AWAIT="1:1", FT_RESTART_AFTER="0"
        ),
    }
    started: dict[str, Any] = {}
    restarter = threading.Thread(
        target=_kill_the_job_and_start_it_again,
        args=(dirs["whole"], dirs["whole_again"], launches["whole"], started),
        daemon=True,
    )
    restarter.start()
    reference = ft.start_launcher(  # the fault-free run, through the one-box launcher's command line
        dirs["reference"], "--groups", "2", "--max-restarts", "0", "--heartbeat-timeout-ms", "1000", "--cold",
        FT_STEPS=str(STEPS),
    )  # fmt: skip
    actor = threading.Thread(
        target=_stop_then_restart_lighthouse, args=(dirs["stop"], launches["stop"][0], events), daemon=True
    )
    actor.start()
    try:
        try:
            code = reference.wait(timeout=200)
        except subprocess.TimeoutExpired:
            code = None
        log = (dirs["reference"] / "log.txt").read_text()[-6000:]
        assert code == 0, f"the launcher's run ended with {code}; log:\n{log}"
        for name in ("stop", "kill", "three"):
            ft.finish(launches[name], dirs[name], timeout=240)
        restarter.join(timeout=200)
        assert "again" in started, "the whole job was not started again"
        ft.finish(started["again"], dirs["whole_again"], timeout=200)
    finally:
        restarter.join(timeout=200)
        if "again" in started:
            stop_groups(started["again"][1])
            started["again"][0].shutdown()
        ft.end_launcher(reference)
        for launch in launches.values():  # a failed finish leaves the others: end them too
            stop_groups(launch[1])
            launch[0].shutdown()
    actor.join(timeout=30)
    return {**dirs, "events": events}


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_sigkill_then_kill_during_recovery_others_keep_their_process_and_nothing_is_lost(runs: dict) -> None:
    """Group 1 dies at step 4 and its first restart dies while recovering; the second restart
    rejoins. Group 0 never restarts, trains alone meanwhile, and the run ends on the fault-free run's
    weights with every step's global batch trained exactly once."""
    out = runs["kill"]
    assert [a for a, _ in ft.pids(out, 0)] == [0], "the healthy group's process was restarted"
    attempts = ft.pids(out, 1)
    assert [a for a, _ in attempts] == [0, 1, 2], "group 1 dies at step 4 and again while recovering"
    assert len({pid for _, pid in attempts}) == 3
    rows = ft.rows(out, 1)
    assert not [r for r in rows if r["attempt"] == 1], "the first restart died before its first step"
    rejoined = [r["step"] for r in rows if r["attempt"] == 2]
    assert rejoined and rejoined[0] > 4, "the restarted group did not start at the quorum's step"
    assert any(r["participants"] == 1 for r in ft.rows(out, 0)), "the survivor never trained alone"
    ft.check_against_reference(runs["reference"], out)


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_three_groups_the_two_survivors_take_over_the_killed_groups_slots(runs: dict) -> None:
    """3 replica groups, group 1 SIGKILLed at step 4: groups 0 and 2 keep their processes and train
    its slots between them (quorums of 2) until its restart rejoins at the quorum's step; every
    step's global batch is trained exactly once and all three end on the fault-free (2-group) run's
    weights: the same gradient terms summed in other groupings, within the module's tolerance."""
    out = runs["three"]
    for group in (0, 2):
        assert [a for a, _ in ft.pids(out, group)] == [0], f"healthy group {group}'s process was restarted"
    assert [a for a, _ in ft.pids(out, 1)] == [0, 1], "group 1 dies at step 4 and restarts once"
    first, back = (
        [r["step"] for r in ft.rows(out, 1) if r["attempt"] == attempt] for attempt in (0, 1)
    )  # fmt: skip
    assert first == [0, 1, 2, 3] and back, "group 1 died at step 4 and its restart trained again"
    out_steps = range(4, back[0])
    assert out_steps, "the restarted group did not rejoin at a later step of the quorum"
    for group in (0, 2):
        pairs = {r["step"]: r["participants"] for r in ft.rows(out, group)}
        assert all(pairs.get(step) == 2 for step in out_steps), (
            f"group {group} did not train every step without group 1 in a quorum of the two survivors"
        )
    assert any(r["participants"] == 3 for r in ft.rows(out, 1) if r["attempt"] == 1), "group 1 never rejoined"
    ft.check_against_reference(runs["reference"], out, groups=3)


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_stopped_group_and_lighthouse_restart_restart_nobody(runs: dict) -> None:
    """A group stopped past the timeout is left out of the quorum and heals from its peer when it
    continues (same process); a Lighthouse down for 2 s and started again is retried, not fatal."""
    out, events = runs["stop"], runs["events"]
    assert "lighthouse_down_at_step" in events, f"the actions did not all run: {events}"
    assert [a for a, _ in ft.pids(out, 0)] == [0] and [a for a, _ in ft.pids(out, 1)] == [0], (
        "a group restarted"
    )
    alone = [r["step"] for r in ft.rows(out, 0) if r["participants"] == 1]
    assert alone and alone[0] >= events["stopped_at_step"] - 1, "group 0 did not go on alone"
    back = [r["step"] for r in ft.rows(out, 1) if r["step"] > alone[0]]
    assert back and back[0] > alone[-1], "the stopped group did not heal to the quorum's step"
    assert events["lighthouse_down_at_step"] < STEPS, "the Lighthouse went down after the run ended"
    ft.check_against_reference(runs["reference"], out)


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_whole_job_ended_resumes_from_its_commit(runs: dict) -> None:
    """Both groups ended at step 17: the job started again resumes from the commit of step 10 (at
    most commit_every=10 steps redone, on the same samples) and ends on the fault-free weights."""
    first, again = runs["whole"], runs["whole_again"]
    resumed = min(r["step"] for r in ft.rows(again, 0))
    ended = max(r["step"] for r in ft.rows(first, 0))
    assert resumed == 10 and 0 < ended + 1 - resumed <= 10, (resumed, ended)
    before = {step: indices for step, indices in ft.steps(first).items() if step < resumed}
    ft.check_against_reference(runs["reference"], again, {**before, **ft.steps(again)})


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_hooks_fire_with_their_steps_the_logs_are_quiet_and_a_resume_says_so(runs: dict) -> None:
    """In every run, each group's batch hooks fired with the ``training_step`` of the batch they were
    given, and only for the batches it trained (the script checks each one's batch and outputs; in
    the fault-free run they are exactly the committed samples); no torchft INFO line, "NCCL flight
    recorder" warning or checkpoint request line in the logs (the launcher's Lighthouse included);
    the job started again from its commits says where it resumed, once per group."""
    for name, groups in (("reference", 2), ("kill", 2), ("stop", 2), ("three", 3), ("whole_again", 2)):
        ft.check_hooks(runs[name], groups, exact=name == "reference")
    for name in ("reference", "kill", "stop", "three", "whole_again"):
        assert not ft.noisy_lines(runs[name]), f"{name}: {ft.noisy_lines(runs[name])[:5]}"
    log = (runs["whole_again"] / "log.txt").read_text()
    said = f"FaultTolerant: resumed from the commit of step 10 ({runs['whole'] / 'ft_commits'}"
    assert log.count(said) == 2, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(500)  # at least twice the runs fixture's 240 s budget
def test_a_kill_and_a_stop_each_give_one_line_per_event(runs: dict) -> None:
    """The killed run's survivor says once that group 1 was lost at step 4 because its process
    exited (the closed connections, not a timeout) and once that the quorum of 1 formed at step 4;
    each restart that healed says from whom, how much and how long. The stopped run says group 1 was
    lost because it did not answer within timeout_s=10 (a SIGSTOPped peer is found by the timeout),
    or, stopped between steps, because its heartbeats stopped. Every group prints its timeouts once
    per process start, and no event line has another shape (``ft.EVENT``)."""
    kill = ft.events(runs["kill"])
    assert kill.count("FaultTolerant: group 1 lost at step 4 (process exit)") == 1, kill
    assert len([e for e in kill if e.startswith("FaultTolerant: quorum of 1 at step 4 in ")]) == 1, kill
    assert [e for e in kill if e.startswith("FaultTolerant: group 1 healed from group 0 at step ")], kill
    print(f"kill -> group 0's next committed step: {ft.kill_to_next_step(runs['kill']):.2f} s")
    stop = ft.events(runs["stop"])
    lost = [e for e in stop if e.startswith("FaultTolerant: group 1 lost at step ")]
    assert lost and lost[0].endswith(("(no answer within 10 s)", "(heartbeats stopped)")), stop
    three = ft.events(runs["three"])
    assert three.count("FaultTolerant: group 1 lost at step 4 (process exit)") == 1, three
    for name, starts in (("reference", 2), ("stop", 2), ("three", 4)):  # group 1 of the three starts twice
        said = (runs[name] / "log.txt").read_text().count("FaultTolerant: timeouts from peer_timeout_s=")
        assert said == starts, (name, said)


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(
    not os.environ.get("LD_SOAK_MINUTES"),
    reason="soak test (minutes): set LD_SOAK_MINUTES=10 (and LD_SOAK_EVERY=45, seconds between kills) to run it",
)
def test_soak_random_kills_lose_nothing(tmp_path: Path) -> None:
    """For LD_SOAK_MINUTES, SIGKILL a random group's worker every LD_SOAK_EVERY seconds (when both
    groups train together); every step's global batch is still trained exactly once, every kill
    restarted only its own group, and the groups end on the same weights."""
    import random

    minutes = float(os.environ["LD_SOAK_MINUTES"])
    every = float(os.environ.get("LD_SOAK_EVERY", "45"))
    steps = int(minutes * 60)  # FT_PAUSE=0.4: about a second a step with both groups
    out = tmp_path / "soak"
    out.mkdir()
    lighthouse = Lighthouse("127.0.0.1:0", heartbeat_timeout_ms=1000)
    procs = start_groups(
        [str(SCRIPT)],
        2,
        lighthouse.address,
        max_restarts=1000,
        env=child_env(FT_OUT=str(out), FT_STEPS=str(steps), FT_PAUSE="0.4", FT_COMMIT_EVERY="20"),
        stdout=open(out / "log.txt", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    kills = {0: 0, 1: 0}
    rng = random.Random(0)
    try:
        last_kill = time.monotonic()
        while any(p.poll() is None for p in procs):
            time.sleep(1)
            together = all(ft.rows(out, g) and ft.rows(out, g)[-1]["participants"] == 2 for g in (0, 1))
            if together and time.monotonic() - last_kill > every:
                group = rng.randrange(2)
                os.kill(ft.pids(out, group)[-1][1], signal.SIGKILL)  # our child's worker, by PID
                kills[group] += 1
                last_kill = time.monotonic()
            assert time.monotonic() - last_kill < 600, "no progress for 10 minutes"
    finally:
        stop_groups(procs)
        lighthouse.shutdown()
    assert [p.returncode for p in procs] == [0, 0], (out / "log.txt").read_text()[-4000:]
    print(f"soak: {steps} steps, kills per group {kills}")
    for group in (0, 1):
        assert len(ft.pids(out, group)) == kills[group] + 1, f"group {group} restarted other than when killed"
    samples = ft.steps(out)
    assert sorted(samples) == list(range(steps))
    for step, indices in samples.items():
        assert len(indices) == GLOBAL_BATCH == len(set(indices)), f"step {step}: a sample lost or repeated"
    assert all(torch.equal(a, b) for a, b in zip(ft.weights(out, 0).values(), ft.weights(out, 1).values()))
