"""Test-tier rules, enforced for every test.

- A test that starts a child process (a training script, mpirun, torchrun, srun, a notebook kernel)
  must be marked ``slow``: ``make test-fast`` (``-m "not slow"``) runs only tests without one. Any
  other test that tries fails at the attempt (setup, call and teardown are all watched).
- A child-process budget (``helpers.run_command``'s ``timeout``) must stay below the running
  test's pytest-timeout, so the budget, which kills the child and shows its output, fires first.

It also holds the session's shared runs (tests/shared_runs.py): one launch per launcher, made by the
first test that asks for it.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helpers
import pytest
import shared_runs
from filelock import FileLock


@contextlib.contextmanager
def _no_child_processes(nodeid: str) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(
            f"{nodeid} starts a child process but is not marked slow: "
            "add @pytest.mark.slow (or pytestmark = pytest.mark.slow) so `make test-fast` leaves it out",
            pytrace=False,
        )

    with pytest.MonkeyPatch.context() as mp:
        # subprocess.Popen/run/check_output, multiprocessing's fork, spawn and forkserver, os.system
        mp.setattr(subprocess.Popen, "_execute_child", refuse)
        mp.setattr(_posixsubprocess, "fork_exec", refuse)
        mp.setattr(os, "fork", refuse)
        mp.setattr(os, "posix_spawn", refuse)
        mp.setattr(os, "posix_spawnp", refuse)
        mp.setattr(os, "system", refuse)
        yield


ONE_AT_A_TIME = ("test_bench_cluster", "test_netns", "test_slurm", "test_slurm_check", "test_slurm_two_nodes")
"""Files that bring up emulated nodes (network namespaces) or the local SLURM nodes: one machine-wide
setup each, so under pytest-xdist they share one worker (group "machine") and never overlap."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group each test for ``pytest -n N --dist loadgroup`` (``make test``): a file's tests stay on
    one worker (its module fixtures run once), the ``ONE_AT_A_TIME`` files all on one."""
    for item in items:
        stem = item.path.stem
        item.add_marker(pytest.mark.xdist_group("machine" if stem in ONE_AT_A_TIME else stem))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if item.get_closest_marker("slow") is not None:
        return (yield)
    with _no_child_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Any:
    """pytest-timeout arms the test's timer (setup to teardown): note its timeout for the helpers."""
    helpers.TEST_TIMEOUT = settings.timeout
    return (yield)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> Any:
    helpers.TEST_TIMEOUT = None
    return (yield)


def _once(
    factory: pytest.TempPathFactory, name: str, make: Callable[[Path], dict[str, Path]]
) -> dict[str, Path]:
    """``make(folder)``, run once per test session: under pytest-xdist the first worker that asks
    runs it (the others wait on a lock) and every worker reads the same result."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(factory.mktemp(name))
    root = factory.getbasetemp().parent  # this session's folder, shared by its workers
    with FileLock(str(root / f"{name}.lock")):
        done = root / f"{name}.json"
        if done.exists():
            return {key: Path(path) for key, path in json.loads(done.read_text()).items()}
        result = make(root / name)
        done.write_text(json.dumps({key: str(path) for key, path in result.items()}))
        return result


@pytest.fixture(scope="session")
def shared_popen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared_runs.POPEN`` and ``POPEN_FILES``: name -> the run's folder (or file)."""
    return _once(tmp_path_factory, "shared_popen", shared_runs.popen)


@pytest.fixture(scope="session")
def shared_torchrun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared_runs.TORCHRUN``: name -> the run's folder."""
    return _once(tmp_path_factory, "shared_torchrun", shared_runs.torchrun)


@pytest.fixture(scope="session")
def shared_mpirun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared_runs.MPIRUN`` and ``MPIRUN_FILES`` (skipped without Horovod or mpirun)."""
    return _once(tmp_path_factory, "shared_mpirun", shared_runs.mpirun)
