"""A timed-out collective names itself and the configured timeout.

Fast tests: the translation of transport errors and the notes on foreign ones
(``lightning_dist.collectives.timeouts``), and real timeouts over in-process Gloo groups (threads). Slow tests: one rank of a two-process DDP fit stops
(SIGSTOP); the other rank fails within the process-group timeout plus a margin with an error that
names the collective and the timeout, and no process is left behind.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from background import BackgroundJobs, Command, python_call
from helpers import SCRIPTS, concurrently, selected_cases, spawned

from lightning_dist.collectives import (
    CollectiveTimeout,
    CommStats,
    Communicator,
    SingleProcessBackend,
    TorchBackend,
)
from lightning_dist.collectives.timeouts import add_timeout_note, is_timeout, translate, transport_text

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"
NCCL_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
    "NumelIn=30432, NumelOut=30432, Timeout(ms)=5000) ran for 5002 milliseconds before timing out."
)
CONTEXT: dict[str, Any] = {"transport": "gloo", "timeout_s": 5.0, "rank": 0, "world_size": 2}


def callback_wrapped(text: str, times: int = 2) -> str:
    """``text`` as torch's future callbacks re-wrap an exception raised in them, ``times`` deep."""
    for _ in range(times):
        text = (
            f"Got the following error when running the callback: RuntimeError: {text}\n\nAt:\n  x.py(1): f\n"
        )
    return text


# -- translation (no transport) ---------------------------------------------------------------------
@pytest.mark.parametrize("text", [GLOO_TIMEOUT, callback_wrapped(GLOO_TIMEOUT), NCCL_TIMEOUT])
def test_a_timeout_becomes_collective_timeout_naming_op_and_timeout(text: str) -> None:
    original = RuntimeError(text)
    err = translate(original, "all_reduce", detail="sum, 30432 float32 elements", **CONTEXT)
    assert isinstance(err, CollectiveTimeout) and isinstance(err, RuntimeError)
    assert err.__cause__ is original
    assert err.op == "all_reduce" and err.timeout_s == 5.0
    message = str(err)
    assert message.startswith("collective all_reduce (sum, 30432 float32 elements) timed out on rank 0 of 2")
    assert "over gloo" in message and "the process group's timeout of 5 s" in message
    assert "raise the strategy's timeout=" in message and "every rank is alive" in message
    assert transport_text(original) in message, "the transport's own words are quoted"
    assert "Got the following error" not in message and "At:" not in message
    assert pickle.loads(pickle.dumps(err)).args == err.args


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
        ),
        RuntimeError("all_gather: tensors may differ only in their first dimension"),
        ValueError("timed out"),  # not a transport error
        TimeoutError("ranks [1] did not finish within 60s"),
    ],
)
def test_other_errors_pass_unchanged(exc: BaseException) -> None:
    assert translate(exc, "all_reduce", **CONTEXT) is exc
    args = exc.args
    assert add_timeout_note(exc, **CONTEXT) is False and exc.args == args
    assert not hasattr(exc, "__notes__"), "no note"


def test_no_note_on_other_timeouts() -> None:
    exc = RuntimeError("DataLoader timed out after 5 seconds")
    assert add_timeout_note(exc, **CONTEXT) is False and str(exc) == "DataLoader timed out after 5 seconds"
    assert not hasattr(exc, "__notes__")


def test_a_rewrapped_collective_timeout_gets_the_recorded_message_as_its_note() -> None:
    first = translate(
        RuntimeError(GLOO_TIMEOUT), "recv", detail="3 float32 elements from rank 1, tag 0", **CONTEXT
    )
    assert isinstance(first, CollectiveTimeout) and first.detail == "3 float32 elements from rank 1, tag 0"
    text = f"Got the following error when running the callback: CollectiveTimeout: {first}\n\nAt:\n  t.py(1): f\n"
    rewrapped = RuntimeError(text)
    assert is_timeout(rewrapped)
    assert add_timeout_note(rewrapped, first, **CONTEXT) is True
    assert rewrapped.args == (text,) and rewrapped.__notes__ == [str(first)], "args kept, one note added"
    assert add_timeout_note(rewrapped, first, **CONTEXT) is True and len(rewrapped.__notes__) == 1, "once"
    assert translate(first, "other", **CONTEXT) is first


def test_unknown_timeout_and_transport_still_say_what_to_do() -> None:
    err = translate(RuntimeError(GLOO_TIMEOUT), "barrier")
    assert isinstance(err, CollectiveTimeout) and err.timeout_s is None
    assert str(err).startswith(
        "collective barrier timed out: it did not complete within the process group's timeout ("
    )
    assert "raise the strategy's timeout=" in str(err)


def test_a_foreign_timeout_keeps_its_args_and_gets_a_note_naming_torch_ddps_own_collective() -> None:
    # a function of that name in a torch.nn.parallel file, as torch DDP's buffer broadcast is
    namespace: dict[str, Any] = {}
    code = f"def _distributed_broadcast_coalesced():\n    raise RuntimeError({GLOO_TIMEOUT!r})\n"
    exec(compile(code, "/site-packages/torch/nn/parallel/distributed.py", "exec"), namespace)
    with pytest.raises(RuntimeError) as info:
        namespace["_distributed_broadcast_coalesced"]()
    exc = info.value
    assert add_timeout_note(exc, **CONTEXT) is True
    assert type(exc) is RuntimeError and exc.args == (GLOO_TIMEOUT,), "type and args stay"
    (note,) = exc.__notes__
    assert note.startswith("the broadcast of module buffers by torch DDP (broadcast_buffers=True) timed out")
    assert "timeout of 5 s" in note and "Timed out waiting 5000ms" in note and "\n" not in note

    text = callback_wrapped("CollectiveTimeout: collective all_reduce (avg, 8 float32 elements) timed out", 1)
    hook_error = RuntimeError(text)
    recorded = CollectiveTimeout("collective all_reduce (avg, 8 float32 elements) timed out", "all_reduce")
    assert add_timeout_note(hook_error, recorded) is True
    assert hook_error.args == (text,) and hook_error.__notes__ == [str(recorded)]


def test_a_note_without_a_transport_still_explains() -> None:
    exc = RuntimeError(callback_wrapped(GLOO_TIMEOUT))
    assert Communicator(SingleProcessBackend()).note_timeout(exc) is True  # a strategy before setup
    assert exc.args == (callback_wrapped(GLOO_TIMEOUT),)
    (note,) = exc.__notes__
    assert note.startswith("a collective timed out: it did not complete within the process group's timeout (")
    assert "Timed out waiting 5000ms" in note and "raise the strategy's timeout=" in note


# -- real timeouts over in-process Gloo groups --------------------------------------------------------
def _rank0_fails(fn: Callable[[Communicator], Any], timeout_s: float = 1.0) -> BaseException:
    """Two Gloo ranks in threads with a ``timeout_s`` group timeout; rank 1 never joins ``fn``: the
    error ``fn`` raises on rank 0."""
    store, prefix = dist.HashStore(), uuid.uuid4().hex
    errors: list[Optional[BaseException]] = [None, None]
    ready = threading.Barrier(2)

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), r, 2, timedelta(seconds=timeout_s))
        comm = Communicator(TorchBackend(group), stats=CommStats())
        comm.barrier()  # both connected
        ready.wait()
        if r == 0:
            try:
                fn(comm)
            except BaseException as exc:  # noqa: BLE001  (checked by the test)
                errors[0] = exc
        else:
            time.sleep(timeout_s + 0.3)  # outlive rank 0's wait, then drop the group

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    err = errors[0]
    assert err is not None, "rank 0 completed a collective that rank 1 never joined"
    return err


OPS: dict[str, tuple[Callable[[Communicator], Any], str]] = {
    "all_reduce": (
        lambda c: c.all_reduce(torch.ones(3), "max"),
        "collective all_reduce (max, 3 float32 elements)",
    ),
    "broadcast": (
        lambda c: c.broadcast(torch.ones(2), src=1),
        "collective broadcast (2 float32 elements from rank 1)",
    ),
    "all_gather": (
        lambda c: c.all_gather(torch.ones(4), same_shape=True),
        "collective all_gather (4 float32 elements)",
    ),
    "reduce_scatter": (
        lambda c: c.reduce_scatter(torch.ones(4)),
        "collective reduce_scatter (sum, 4 float32 elements)",
    ),
    "all_to_all": (
        lambda c: c.all_to_all([torch.ones(1), torch.ones(1)]),
        "collective all_to_all (row-count exchange",
    ),
    "barrier": (lambda c: c.barrier(), "collective barrier timed out"),
}


@pytest.fixture(scope="module")
def never_joined(request: pytest.FixtureRequest) -> dict[str, BaseException]:
    """``_rank0_fails`` of every ``OPS`` entry this session tests, all at once (each its own store and
    groups; each waits out its timeout): name -> rank 0's error, or why there was none (its test
    raises that)."""

    def fails(name: str) -> BaseException:
        try:
            return _rank0_fails(OPS[name][0])
        except AssertionError as exc:  # rank 0 got no error
            return exc

    test = test_a_peer_that_never_joins_raises_collective_timeout
    return concurrently({name: partial(fails, name) for (name,) in selected_cases(request, test, "name")})


@pytest.mark.parametrize("name", list(OPS))
def test_a_peer_that_never_joins_raises_collective_timeout(
    never_joined: dict[str, BaseException], name: str
) -> None:
    start, err = OPS[name][1], never_joined[name]
    if isinstance(err, AssertionError):
        raise err
    assert isinstance(err, CollectiveTimeout), repr(err)
    assert str(err).startswith(start), str(err)
    assert "on rank 0 of 2 over gloo" in str(err) and "timeout of 1 s" in str(err)
    assert err.timeout_s == 1.0
    cause = err.__cause__
    assert cause is not None and not isinstance(cause, CollectiveTimeout), "raised from the transport's error"
    assert "Timed out waiting 1000ms" in transport_text(cause) and "CollectiveTimeout" not in str(cause)


def test_an_async_future_carries_the_message() -> None:
    """A future's error crosses torch's callback wrapping: a plain RuntimeError, our text inside."""
    err = _rank0_fails(lambda c: c.all_reduce_async(torch.ones(3)).wait())
    assert type(err) is RuntimeError and is_timeout(err)
    assert "CollectiveTimeout: collective all_reduce (sum, 3 float32 elements)" in str(err)
    assert "timeout of 1 s" in str(err)


def test_a_strategy_notes_a_foreign_error_with_its_communicators_timeout() -> None:
    """What reaches ``on_exception`` after a DDP comm hook's future timed out: torch's re-wrapped
    ``RuntimeError``. It keeps its type and args; the note is the collective that timed out."""
    got: dict[str, Any] = {}

    def hook_then_reducer(comm: Communicator) -> None:
        got["comm"] = comm
        comm.all_reduce_async(torch.ones(3), "avg").then(lambda f: f.value()).wait()

    err = _rank0_fails(hook_then_reducer)
    args = err.args
    assert type(err) is RuntimeError and is_timeout(err)
    assert got["comm"].note_timeout(err) is True
    assert err.args == args
    (note,) = err.__notes__
    assert note.startswith(
        "collective all_reduce (avg, 3 float32 elements) timed out on rank 0 of 2 over gloo"
    )
    assert "within the process group's timeout of 1 s" in note and "raise the strategy's timeout=" in note


def test_ddp_on_exception_adds_the_note_and_keeps_the_args() -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_dist import DDP

    exc = RuntimeError(callback_wrapped(GLOO_TIMEOUT))
    DDP(cluster_environment=LightningEnvironment()).on_exception(exc)
    assert type(exc) is RuntimeError and exc.args == (callback_wrapped(GLOO_TIMEOUT),)
    assert len(exc.__notes__) == 1 and "raise the strategy's timeout=" in exc.__notes__[0]


def test_timeout_is_read_from_the_default_group() -> None:
    """What ``DDP`` makes: ``init_process_group(timeout=...)``, read back by ``TorchBackend``."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=7)
    )
    try:
        backend = TorchBackend()
        assert backend.timeout_s == 7.0 and backend.transport == "gloo"
    finally:
        dist.destroy_process_group()


# -- a stopped rank in a two-process fit ----------------------------------------------------------------
TIMEOUT_S = 5
"""The process-group timeout the fit runs with (``DDP(timeout=timedelta(seconds=5))``)."""
ERROR_MARGIN_S = 5.0
"""Rank 0's error comes at most this long after the timeout (measured: 0.02 s)."""
EXIT_MARGIN_S = 15.0
"""Rank 0's process, the stopped rank and the launch are gone at most this long after the timeout
(plus, under torchrun, its grace; measured: rank 0 exits about 1 s after its error)."""
TORCHRUN_GRACE_S = 30.0
"""torchrun's agent, once a worker failed, SIGTERMs the others and SIGKILLs them 30 s later (torch
2.13's ``LocalElasticAgent._stop_workers``, which ``--shutdown-timeout`` does not reach). A stopped
process holds the SIGTERM pending, so it is the SIGKILL, 30 s on, that ends it."""
BUDGET_S = 150.0
"""One launch at most: start-up (imports, rendezvous: 5-20 s on 2 CPUs), three steps, the timeout,
the grace and the margins. The background command that runs them all gets 30 s more (its own Python's
start), half the tests' timeout."""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process of the script."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            ours = b"stopped_rank.py" in fh.read()
    except (OSError, IndexError):
        return False
    return ours and state != "Z"


def _launch(out: Path, launcher: str, stop_at: str) -> dict[str, Any]:
    """Run the fit and watch its ranks' processes until all have ended, or until the stopped rank's
    SIGSTOP is ``TIMEOUT_S`` + ``EXIT_MARGIN_S`` (+ torchrun's grace) old. Returns the launch's exit
    code, when (``time.time()``) each rank's process and the launch ended, and the pids of the
    script's processes still alive then (``left``), which are killed: they are no longer the launch's
    descendants when their parent has exited, so ``spawned`` would miss them."""
    script = [
        str(SCRIPTS / "stopped_rank.py"),
        "--timeout",
        str(TIMEOUT_S),
        "--stop-at",
        stop_at,
        "--out",
        str(out),
    ]
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
        ]
    else:  # Lightning's own: rank 0 starts rank 1
        cmd = [sys.executable]
    grace = TORCHRUN_GRACE_S if launcher == "torchrun" else 0.0
    out.mkdir()
    pids: dict[int, int] = {}
    gone: dict[int, float] = {}
    ended: Optional[float] = None
    with spawned(cmd + script, out / "launch.log") as proc:
        deadline = time.time() + BUDGET_S
        while time.time() < deadline:
            for rank in (0, 1):
                pid_file = out / f"rank{rank}.pid"
                if rank not in pids and pid_file.exists() and pid_file.read_text().strip():
                    pids[rank] = int(pid_file.read_text())
                if rank in pids and rank not in gone and not _alive(pids[rank]):
                    gone[rank] = time.time()
            if ended is None and proc.poll() is not None:
                ended = time.time()
            if ended is not None and len(gone) == 2:
                break
            if (out / "stopped.json").exists():
                t_stop = json.loads((out / "stopped.json").read_text())["time"]
                deadline = min(deadline, t_stop + TIMEOUT_S + EXIT_MARGIN_S + grace + 1)
            time.sleep(0.05)
        left = [pid for pid in pids.values() if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return {"returncode": proc.returncode if ended else None, "pids": pids, "gone": gone, "ended": ended,
            "left": left, "log": (out / "launch.log").read_text()}  # fmt: skip


STOPS = {
    # where rank 1 stops: the type and the start of rank 0's error
    "training_step": (
        "CollectiveTimeout",
        "collective all_reduce (avg, 1 float32 element) timed out on rank 0 of 2",
    ),
    "backward": (
        "RuntimeError",
        "collective all_reduce (avg, 30432 float32 elements) timed out on rank 0 of 2",
    ),
    "batch_start": (
        "RuntimeError",
        "the broadcast of module buffers by torch DDP (broadcast_buffers=True) timed out",
    ),
}


CASES = [
    ("torchrun", "backward"),  # torchrun once: its agent's fixed grace makes each case 30 s longer
    ("lightning", "training_step"),
    ("lightning", "backward"),
    ("lightning", "batch_start"),
]


def stopped_launches(root: Path) -> dict[str, dict[str, Any]]:
    """``_launch`` of every case, all at once (the launches spend most of their time waiting: the
    timeout, torchrun's grace), so together they take about as long as the longest alone, each within
    ``BUDGET_S``. Runs in the background (tests/background.py); "launcher-stop_at" -> the result."""
    outs = {"-".join(case): root / "-".join(case) for case in CASES}
    return concurrently({name: partial(_launch, out, *name.split("-")) for name, out in outs.items()})


@pytest.fixture(scope="module")
def stopped_runs(background_jobs: BackgroundJobs) -> dict[tuple[str, str], tuple[Path, dict[str, Any]]]:
    """``stopped_launches``' results: (launcher, stop_at) -> (its out folder, ``_launch``'s result)."""
    done = background_jobs.result(stopped)
    runs = {}
    for name, run in done.value().items():
        run["pids"] = {int(rank): pid for rank, pid in run["pids"].items()}  # JSON's keys are text
        run["gone"] = {int(rank): t for rank, t in run["gone"].items()}
        runs[tuple(name.split("-"))] = (done.out / name, run)
    return runs


def stopped(out: Path) -> Command:
    """``stopped_launches`` in a Python of its own, beside the session's other tests."""
    return python_call(stopped_launches, out, BUDGET_S + 30)


@pytest.mark.slow
@pytest.mark.timeout(2 * (BUDGET_S + 30))
@pytest.mark.background(make=stopped)
@pytest.mark.parametrize(("launcher", "stop_at"), CASES)
def test_a_stopped_rank_fails_the_others_with_the_collective_and_the_timeout(
    stopped_runs: dict[tuple[str, str], tuple[Path, dict[str, Any]]], launcher: str, stop_at: str
) -> None:
    out, run = stopped_runs[launcher, stop_at]
    log = run["log"][-5000:]
    assert sorted(run["pids"]) == [0, 1], log
    assert (out / "stopped.json").exists(), f"rank 1 never reached its stop ({stop_at}):\n{log}"
    stopped = json.loads((out / "stopped.json").read_text())
    assert stopped["rank"] == 1 and stopped["at"] == stop_at
    t_stop = stopped["time"]
    error = json.loads((out / "rank0.error.json").read_text())

    # rank 0 fails after the configured timeout (not before) and exits; the launch fails
    since = {
        name: t - t_stop
        for name, t in [("error", error["time"]), *run["gone"].items(), ("launch", run["ended"])]
        if t
    }
    print(f"{launcher}, stopped at {stop_at}: seconds after the SIGSTOP {since}, left behind {run['left']}")
    assert TIMEOUT_S - 0.5 <= since["error"] <= TIMEOUT_S + ERROR_MARGIN_S, since
    assert 0 in since and since[0] <= TIMEOUT_S + EXIT_MARGIN_S, (since, log)
    assert run["returncode"] not in (None, 0), log

    # under torchrun the stopped rank is killed (after the agent's grace) and nothing is left behind
    if launcher == "torchrun":
        assert not run["left"], f"left behind: {run['left']}\n{log}"
        assert since[1] <= TIMEOUT_S + TORCHRUN_GRACE_S + EXIT_MARGIN_S, since
        assert since["launch"] <= TIMEOUT_S + TORCHRUN_GRACE_S + EXIT_MARGIN_S, since

    # rank 0's error names the collective and the timeout
    kind, start = STOPS[stop_at]
    text = error["text"]
    assert error["type"] == kind, text[-3000:]
    line = next((line for line in text.splitlines() if start in line), None)  # the message's line
    assert line is not None, text[-3000:]
    assert "within the process group's timeout of 5 s" in line and "Timed out waiting 5000ms" in line
    assert "raise the strategy's timeout=" in line

    # under Lightning's launcher, rank 0 is the stopped rank's parent: nothing else will end it
    if launcher == "lightning":
        assert not run["left"], f"left behind: {run['left']}\n{log}"
        assert since[1] <= TIMEOUT_S + EXIT_MARGIN_S, since
