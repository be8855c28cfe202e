"""Each strategy owns its communicator: no module-global transport, one meaning for the counters
(each communicator's own ``stats``), and a teardown that stops only its own helper threads.

Fast: static checks of the package's code, and communicators over threaded Gloo groups."""

from __future__ import annotations

import ast
import threading
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from helpers import ROOT
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator

from lightning_dist import DDP, collectives
from lightning_dist.collectives import Communicator, TorchBackend
from lightning_dist.collectives import completer as completer_mod
from lightning_dist.collectives.adasum import adasum_reference
from lightning_dist.collectives.completer import Completer

PACKAGE = ROOT / "lightning_dist"
USER_CONVENIENCE = {name for name in collectives.__all__ if name[0].islower()} - {
    "check_reduce_op",
    "ring_all_reduce_bytes",
    "trace",
}
"""The module-level names of ``collectives`` that act on ``world()`` (user code only), plus ``shutdown``."""


def _module_level_uses(path: Any) -> list[str]:
    """``collectives.<name>`` attribute reads and ``from lightning_dist.collectives import <name>``
    imports of ``USER_CONVENIENCE`` in one file (``line: name``)."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "collectives"
            and node.attr in USER_CONVENIENCE
        ):
            found.append(f"{node.lineno}: collectives.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_dist.collectives":
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in USER_CONVENIENCE]
    return found


def test_library_code_never_reads_the_module_level_transport() -> None:
    """Only user code calls ``collectives.world()`` and the functions acting on it; the pack's own
    code goes through a strategy's communicator. ``shutdown`` (end of a script) is the exception,
    for the workload's command line."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.as_posix() == "collectives/__init__.py":
            continue
        uses = [u for u in _module_level_uses(path) if not u.endswith("shutdown")]
        if uses:
            offenders[str(rel)] = uses
    assert offenders == {}, f"library code reading the module-level transport: {offenders}"
    user_script = _module_level_uses(ROOT / "scripts" / "gpu_collectives_check.py")
    assert any("collectives.all_reduce" in u for u in user_script), "the check finds a real use"


def test_there_is_no_installed_transport() -> None:
    for name in ("use", "current", "release", "stats", "reset_stats", "_installed", "_default"):
        assert not hasattr(collectives, name), name


def _groups(world_size: int, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per rank, one Gloo group per name (independent worlds in one process), made in threads."""
    store = dist.HashStore()
    prefix = uuid.uuid4().hex
    out: list[dict[str, Any]] = [{} for _ in range(world_size)]

    def make(r: int, name: str) -> None:
        out[r][name] = dist.ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/{name}", store), r, world_size, timedelta(seconds=30)
        )

    threads = [threading.Thread(target=make, args=(r, n)) for r in range(world_size) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _on_ranks(world_size: int, fn: Any) -> list[Any]:
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _strategy(comm: Communicator) -> DDP:
    strategy = DDP(accelerator=CPUAccelerator(), cluster_environment=LightningEnvironment())
    assert strategy.communicator is None, "no communicator before setup"
    strategy._set_communicator(comm)
    return strategy


def test_two_strategies_in_one_process_count_separately() -> None:
    groups = _groups(2, ("a", "b"))

    def body(r: int) -> tuple[dict[str, float], dict[str, float]]:
        a = _strategy(Communicator(TorchBackend(groups[r]["a"])))
        b = _strategy(Communicator(TorchBackend(groups[r]["b"])))
        assert a.communicator is not None and b.communicator is not None
        a.reduce(torch.ones(4), reduce_op="sum")
        b.reduce(torch.ones(100), reduce_op="sum")
        b.barrier()
        return a.communicator.stats.snapshot(), b.communicator.stats.snapshot()

    for snap_a, snap_b in _on_ranks(2, body):
        assert snap_a["calls"] == 1 and snap_a["bytes_sent"] == 16  # a ring at W=2 sends N bytes
        assert snap_b["calls"] == 2 and snap_b["bytes_sent"] == 400 and snap_b["barrier.calls"] == 1


def test_teardown_stops_only_its_own_communicators_threads(monkeypatch: Any) -> None:
    """Strategy a's teardown stops the helper threads of a's communicator (Adasum lanes, Gloo
    point-to-point waits) and leaves b's running, with b's Adasum in flight across it."""
    monkeypatch.setattr(completer_mod, "IDLE_S", 30.0)  # idle threads stay up while the test looks
    groups = _groups(2, ("a", "b"))

    def threads(comm: Communicator) -> list[Completer]:
        assert isinstance(comm.backend, TorchBackend)
        return [*comm._lanes._workers, *comm.backend._completers.values()]

    def body(r: int) -> tuple[list[bool], list[bool], torch.Tensor, torch.Tensor]:
        a = _strategy(Communicator(TorchBackend(groups[r]["a"])))
        b = _strategy(Communicator(TorchBackend(groups[r]["b"])))
        assert a.communicator is not None and b.communicator is not None
        for comm in (a.communicator, b.communicator):  # two calls: both lanes and their tags at work
            futs = [comm.all_reduce_async([torch.full((8,), float(r + i))], "adasum") for i in range(2)]
            for fut in futs:
                fut.wait()
        late = b.communicator.all_reduce_async([torch.full((8,), float(r))], "adasum")
        a.teardown()
        a_running = [c.running for c in threads(a.communicator)]
        b_running = [c.running for c in threads(b.communicator)]
        got = late.wait()[0]
        summed = b.communicator.all_reduce(torch.ones(3))  # b still works
        b.teardown()
        assert not any(c.running for c in threads(b.communicator)), "b's own teardown stops b's threads"
        return a_running, b_running, got, summed

    for a_running, b_running, got, summed in _on_ranks(2, body):
        assert len(a_running) == len(b_running) == 4, "two lanes and two point-to-point tags each"
        assert not any(a_running), "a's teardown stops a's threads"
        assert all(b_running), "a's teardown leaves b's threads running"
        torch.testing.assert_close(got, adasum_reference([torch.zeros(8), torch.ones(8)]))
        assert torch.equal(summed, torch.full((3,), 2.0))
