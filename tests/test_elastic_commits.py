"""CommitStore: atomic, checksummed, weights-only training-state commits, and the RNG state helpers."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import bad_integers

from lightning_dist.elastic import BackgroundWriter, commits
from lightning_dist.elastic.commits import (
    Commit,
    CommitStore,
    CommitWarning,
    capture_rng_state,
    restore_rng_state,
)


@pytest.fixture(autouse=True)
def _keep_global_rng_states() -> Iterator[None]:
    """These tests seed and draw from the global RNGs: leave them as they were for other tests."""
    states = capture_rng_state()
    yield
    restore_rng_state(states)


def _touch(path: str) -> None:
    Path(path).touch()


class _Trap:
    """Unpickling this object creates ``marker``: what a malicious payload could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _touch, (str(self.marker),)


def _frame(payload: bytes) -> bytes:
    """A well-formed commit file (right magic, length and checksum) around ``payload``."""
    digest = hashlib.sha256(payload).digest()
    return commits._HEADER.pack(commits._MAGIC, commits._VERSION, len(payload), digest) + payload


def _training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(3, 4)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": capture_rng_state(),
        "global_step": 120,
        "loss": 0.25,
        "name": "run-a",
        "done": False,
        "note": None,
        "shape": torch.Size([3, 4]),
        "dtype": torch.bfloat16,
    }


def _assert_equal(actual: Any, expected: Any, path: str = "state") -> None:
    assert type(actual) is type(expected), path
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            _assert_equal(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, path


def _save_steps(store: CommitStore, *steps: int) -> None:
    for step in steps:
        store.save(step, {"step": step, "weight": torch.full((4,), float(step))})


def _load_warning(store: CommitStore) -> tuple[Commit | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commit = store.load_latest()
    return commit, [str(w.message) for w in caught if issubclass(w.category, CommitWarning)]


def test_round_trip_of_a_realistic_training_state(tmp_path: Path) -> None:
    store = CommitStore(tmp_path / "commits")
    state = _training_state()
    path = store.save(120, state)
    assert path == tmp_path / "commits" / "commit-00000120.pt"
    commit = store.load_latest()
    assert commit is not None
    assert (commit.step, commit.path) == (120, path)
    _assert_equal(commit.state, state)
    assert commit.state["model"]._metadata == state["model"]._metadata  # Module.load_state_dict needs it


def test_loaded_state_restores_a_model_optimizer_and_scheduler(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    store.save(1, _training_state())
    commit = store.load_latest()
    assert commit is not None
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model.load_state_dict(commit.state["model"])
    optimizer.load_state_dict(commit.state["optimizer"])
    scheduler.load_state_dict(commit.state["scheduler"])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_empty_or_missing_directory_has_no_commit(tmp_path: Path) -> None:
    for store in (CommitStore(tmp_path), CommitStore(tmp_path / "absent")):
        assert store.load_latest() is None
        assert store.steps() == []
        assert store.latest_step() is None
    assert not (tmp_path / "absent").exists()  # readers create nothing


def test_keep_retains_exactly_the_newest_commits(tmp_path: Path) -> None:
    store = CommitStore(tmp_path, keep=3)
    _save_steps(store, 10, 20, 30, 40, 50, 60)
    assert store.steps() == [40, 50, 60]
    assert store.latest_step() == 60
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"commit-000000{s}.pt" for s in (40, 50, 60)]
    _save_steps(store, 60)  # re-saving a step replaces it
    assert store.steps() == [40, 50, 60]


def test_keep_one_never_prunes_the_commit_just_written(tmp_path: Path) -> None:
    store = CommitStore(tmp_path, keep=1)
    _save_steps(store, 5, 9)
    assert store.steps() == [9]
    _save_steps(store, 7)  # a run that resumed from an earlier commit
    assert store.steps() == [7, 9]


def test_steps_ignore_other_files(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 3, 123456789)
    for name in (
        "commit-1.pt",
        "commit-000000007.pt",
        "commit-00000004.pt.bak",
        "notes.txt",
        ".commit-00000005.pt.1.ab.tmp",
    ):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "commit-00000006.pt").mkdir()
    assert store.steps() == [3, 123456789]
    commit = store.load_latest()
    assert commit is not None and commit.step == 123456789


def test_crash_while_writing_keeps_the_previous_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10)
    real_save = torch.save

    def partial_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half of a zip file")
        assert store.steps() == [10]  # mid-write: nothing under a final name yet
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", partial_save)
    with pytest.raises(OSError, match="disk full"):
        _save_steps(store, 20)
    monkeypatch.setattr(torch, "save", real_save)
    assert store.steps() == [10]
    assert [p.name for p in tmp_path.iterdir()] == ["commit-00000010.pt"]  # temp file removed
    commit = store.load_latest()
    assert commit is not None and commit.step == 10


def test_failed_rename_keeps_the_previous_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10)

    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        _save_steps(store, 20)
    monkeypatch.undo()
    assert store.steps() == [10]
    assert [p.name for p in tmp_path.iterdir()] == ["commit-00000010.pt"]


def test_temp_file_left_by_a_dead_writer_is_ignored_then_cleaned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10)

    def die(src: Any, dst: Any) -> None:
        raise KeyboardInterrupt  # the process "dies" before the rename ...

    monkeypatch.setattr(os, "replace", die)
    monkeypatch.setattr(commits, "_remove", lambda path: None)  # ... and cleans nothing up
    with pytest.raises(KeyboardInterrupt):
        _save_steps(store, 20)
    monkeypatch.undo()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".commit-00000020.pt.")
    assert store.steps() == [10]
    commit = store.load_latest()
    assert commit is not None and commit.step == 10
    _save_steps(store, 30)  # the writer's next save removes the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commit-00000010.pt", "commit-00000030.pt"]


def test_truncated_newest_commit_is_skipped_with_a_warning(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10, 20)
    newest = store.path(20)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    commit, messages = _load_warning(store)
    assert commit is not None and commit.step == 10
    assert commit.state["step"] == 10 and torch.equal(commit.state["weight"], torch.full((4,), 10.0))
    assert len(messages) == 1 and str(newest) in messages[0] and "truncated" in messages[0]


def test_commit_shorter_than_the_header_is_skipped(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10)
    store.path(20).write_bytes(b"LDCOMM")
    commit, messages = _load_warning(store)
    assert commit is not None and commit.step == 10
    assert len(messages) == 1 and "truncated" in messages[0]


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        (-100, "checksum mismatch"),
        (0, "not a commit file"),
        (9, "format version"),
        (19, "truncated"),
        (21, "checksum"),
    ],
    ids=["payload", "magic", "version", "length", "digest"],
)
def test_bit_flipped_newest_commit_is_skipped_with_a_warning(tmp_path: Path, where: int, reason: str) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10, 20)
    newest = store.path(20)
    data = bytearray(newest.read_bytes())
    data[where] ^= 0x10
    newest.write_bytes(bytes(data))
    commit, messages = _load_warning(store)
    assert commit is not None and commit.step == 10
    assert len(messages) == 1 and str(newest) in messages[0] and reason in messages[0]


def test_trailing_bytes_are_detected(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10, 20)
    with open(store.path(20), "ab") as file:
        file.write(b"junk")
    commit, messages = _load_warning(store)
    assert commit is not None and commit.step == 10
    assert len(messages) == 1 and "trailing bytes" in messages[0]


def test_all_commits_damaged_gives_none_and_a_warning_each(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10, 20)
    for step in (10, 20):
        store.path(step).write_bytes(b"garbage" * 20)
    commit, messages = _load_warning(store)
    assert commit is None
    assert len(messages) == 2


def test_pickled_object_in_a_commit_is_refused_and_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "marker"
    store = CommitStore(tmp_path / "commits")
    _save_steps(store, 10)
    pickle.loads(pickle.dumps(_Trap(tmp_path / "live")))  # the trap is live: unpickling runs it
    assert (tmp_path / "live").exists()

    monkeypatch.setattr(commits, "_check_state", lambda state: None)  # a writer that skips the check
    store.save(20, {"step": 20, "payload": _Trap(marker)})
    monkeypatch.undo()
    assert store.steps() == [10, 20]
    commit, messages = _load_warning(store)
    assert not marker.exists()
    assert commit is not None and commit.step == 10
    assert len(messages) == 1 and str(store.path(20)) in messages[0] and "weights_only" in messages[0]
    assert "_touch" in messages[0]  # names the refused global


def test_raw_pickle_payload_is_refused_and_does_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    store = CommitStore(tmp_path / "commits")
    _save_steps(store, 10)
    store.path(20).write_bytes(_frame(pickle.dumps({"state": _Trap(marker)}, protocol=2)))
    commit, messages = _load_warning(store)
    assert not marker.exists()
    assert commit is not None and commit.step == 10
    assert len(messages) == 1 and str(store.path(20)) in messages[0]


def test_payload_that_is_not_a_dict_is_skipped(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 10)
    buffer = io.BytesIO()
    torch.save([1, 2, 3], buffer)
    store.path(20).write_bytes(_frame(buffer.getvalue()))
    commit, messages = _load_warning(store)
    assert commit is not None and commit.step == 10
    assert len(messages) == 1 and "not a dict" in messages[0]


_Pair = namedtuple("_Pair", "a b")


@pytest.mark.parametrize(
    ("state", "path", "type_name"),
    [
        ({"a": {"b": [1, object()]}}, "state['a']['b'][1]", "builtins.object"),
        (
            {"opt": {"state": {0: {"fn": len}}}},
            "state['opt']['state'][0]['fn']",
            "builtin_function_or_method",
        ),
        ({"counts": defaultdict(int)}, "state['counts']", "collections.defaultdict"),
        ({"pair": _Pair(1, 2)}, "state['pair']", "_Pair"),
        ({"x": (1, {2})}, "state['x'][1]", "builtins.set"),
        ({"p": Path("x")}, "state['p']", "Path"),
    ],
    ids=["object", "function", "defaultdict", "namedtuple", "set", "path"],
)
def test_save_refuses_state_weights_only_loading_cannot_read(
    tmp_path: Path, state: dict[str, Any], path: str, type_name: str
) -> None:
    store = CommitStore(tmp_path)
    with pytest.raises(ValueError, match="accepted: torch.Tensor") as err:
        store.save(1, state)
    assert path in str(err.value) and type_name in str(err.value)
    assert list(tmp_path.iterdir()) == []  # refused before writing anything


def test_save_refuses_numpy_values(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    store = CommitStore(tmp_path)
    with pytest.raises(ValueError, match=r"state\['arr'\] is a numpy.ndarray"):
        store.save(1, {"arr": np.zeros(3)})
    with pytest.raises(ValueError, match=r"state\['lr'\] is a numpy.float64"):
        store.save(1, {"lr": np.float64(0.1)})


def test_save_refuses_bad_keys_cycles_and_non_dicts(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    with pytest.raises(ValueError, match=r"state\['a'\] has a key of type _Pair"):
        store.save(1, {"a": {_Pair(1, 2): 1}})
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match=r"state\['c'\]\[0\] contains itself"):
        store.save(1, {"c": cyclic})
    with pytest.raises(ValueError, match="state must be a dict, got list"):
        store.save(1, [1])  # type: ignore[arg-type]
    shared = torch.zeros(2)
    store.save(1, {"a": shared, "b": [shared, shared], "c": OrderedDict(x=(shared,))})  # sharing is fine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        *bad_integers("keep", owner="CommitStore"),
        ({"dirpath": 3}, "dirpath=3 must be a non-empty str or os.PathLike path"),
        ({"dirpath": ""}, "dirpath='' must be a non-empty str or os.PathLike path"),
        ({"dirpath": None}, "dirpath=None must be a non-empty str or os.PathLike path"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    arguments = {"dirpath": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CommitStore(**arguments)


def test_bad_save_arguments_and_file_as_directory(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    for step in (-1, 1.0, None):
        with pytest.raises(ValueError, match=r"CommitStore.save: step=.* must be an integer >= 0"):
            store.save(step, {})  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="must be a directory"):
        CommitStore(tmp_path / "file")


def test_reader_relists_when_the_writer_prunes_during_a_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CommitStore(tmp_path, keep=1)
    reader = CommitStore(tmp_path)
    _save_steps(writer, 10)
    real_read = commits._read_commit
    calls: list[Path] = []

    def read_while_writer_saves(path: Path, map_location: Any) -> dict[str, Any]:
        calls.append(path)
        if len(calls) == 1:
            _save_steps(writer, 20)  # prunes step 10, which the reader listed
        return real_read(path, map_location)

    monkeypatch.setattr(commits, "_read_commit", read_while_writer_saves)
    commit, messages = _load_warning(reader)
    assert commit is not None and commit.step == 20
    assert messages == []
    assert calls == [writer.path(10), writer.path(20)]


def test_map_location_is_passed_to_torch_load(tmp_path: Path) -> None:
    store = CommitStore(tmp_path)
    _save_steps(store, 1)
    commit = store.load_latest(map_location=torch.device("meta"))
    assert commit is not None and commit.state["weight"].device.type == "meta"


def _draws() -> tuple[list[float], list[float], torch.Tensor]:
    np = pytest.importorskip("numpy")
    return (
        [random.random(), random.gauss(0, 1)],
        [float(x) for x in np.random.standard_normal(3)],
        torch.rand(5),
    )


def test_rng_capture_and_restore_reproduce_the_same_draws(tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    import numpy as np

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leave cached gaussians in python's and numpy's state
    np.random.standard_normal()
    states = capture_rng_state()
    assert set(states) >= {"python", "numpy", "torch"}
    expected = _draws()

    store = CommitStore(tmp_path)
    store.save(1, {"rng": states})  # plain types: a commit accepts them
    commit = store.load_latest()
    assert commit is not None
    _draws()  # move all generators on
    restore_rng_state(commit.state["rng"])
    actual = _draws()
    assert actual[0] == expected[0] and actual[1] == expected[1]
    assert torch.equal(actual[2], expected[2])


def test_restore_rng_state_accepts_a_subset_and_refuses_unknown_keys() -> None:
    state = capture_rng_state()
    expected = torch.rand(3)
    restore_rng_state({"torch": state["torch"]})
    assert torch.equal(torch.rand(3), expected)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['mps'\]; accepted: python, numpy, torch, cuda"):
        restore_rng_state({"mps": 1})
    with pytest.raises(ValueError, match="states must be a dict"):
        restore_rng_state([])  # type: ignore[arg-type]


def test_background_writer_writes_the_state_as_of_submit(tmp_path: Path) -> None:
    store = CommitStore(tmp_path, keep=2)
    writer = BackgroundWriter(store)
    weights = torch.zeros(1000)
    for step in (1, 2, 3):
        weights.fill_(step)
        writer.submit(step, {"weights": weights, "meta": {"step": step}})
        weights.fill_(-1.0)  # the optimizer goes on while the commit is written
    writer.wait()
    assert store.steps() == [2, 3]
    latest = store.load_latest()
    assert latest is not None and latest.step == 3
    assert torch.equal(latest.state["weights"], torch.full((1000,), 3.0)) and latest.state["meta"] == {
        "step": 3
    }
    assert writer.last_path == store.path(3)


def test_background_writer_raises_a_failed_write_on_the_next_call(tmp_path: Path) -> None:
    writer = BackgroundWriter(CommitStore(tmp_path))
    writer.submit(1, {"bad": object()})  # refused by the weights-only check inside save
    with pytest.raises(RuntimeError, match=r"writing a commit to .* failed: .*bad"):
        writer.wait()
    writer.wait()  # reported once
    writer.submit(2, {"ok": torch.ones(2)})
    writer.close()
    assert CommitStore(tmp_path).steps() == [2]
