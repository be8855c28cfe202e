"""Test-tier rules, enforced for every test.

- A test that starts a child process (a training script, mpirun, torchrun, srun, a notebook kernel)
  must be marked ``slow``: ``make test-fast`` (``-m "not slow"``) runs only tests without one. Any
  other test that tries fails at the attempt (setup, call and teardown are all watched).
- A child-process budget (``helpers.run_command``'s ``timeout``) must stay below the running
  test's pytest-timeout, so the budget, which kills the child and shows its output, fires first.

It also holds the session's shared runs (tests/shared_runs.py): one launch per launcher, made by the
first test that asks for it; and its background commands (tests/background.py): those of the selected
tests marked ``background`` are queued when collection is done and run one at a time beside the
other tests, and those tests run last.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helpers
import pytest
import shared_runs
from background import BackgroundJobs

_BACKGROUND = BackgroundJobs()


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that read a background command run last, so the command has the session to run in."""
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background command of every selected test that will run."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("background")
        skipped = item.get_closest_marker("skip") is not None or any(
            m.args and m.args[0] is True for m in item.iter_markers("skipif")
        )
        if marker is not None and not skipped:
            _BACKGROUND.start(marker.kwargs["make"])


def pytest_sessionfinish(session: pytest.Session) -> None:
    _BACKGROUND.close()


@pytest.fixture(scope="session")
def background_jobs() -> BackgroundJobs:
    """The session's background commands (tests/background.py)."""
    return _BACKGROUND


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        if item.get_closest_marker("slow") is not None:
            return (yield)
        with _no_child_processes(item.nodeid):
            return (yield)
    finally:
        _BACKGROUND.pump()  # between tests, outside the guard: the next background command, if a lane is free


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Any:
    """pytest-timeout arms the test's timer (setup to teardown): note its timeout for the helpers."""
    helpers.TEST_TIMEOUT = settings.timeout
    return (yield)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> Any:
    helpers.TEST_TIMEOUT = None
    return (yield)


@pytest.fixture(scope="session")
def shared_popen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared_runs.POPEN`` and ``POPEN_FILES``: name -> the run's folder (or file)."""
    return shared_runs.popen(tmp_path_factory.mktemp("shared_popen"))


@pytest.fixture(scope="session")
def shared_torchrun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared_runs.TORCHRUN``: name -> the run's folder."""
    return shared_runs.torchrun(tmp_path_factory.mktemp("shared_torchrun"))


@pytest.fixture(scope="session")
def shared_mpirun(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``shared_runs.MPIRUN`` and ``MPIRUN_FILES`` (skipped without Horovod or mpirun)."""
    return shared_runs.mpirun(tmp_path_factory.mktemp("shared_mpirun"))
