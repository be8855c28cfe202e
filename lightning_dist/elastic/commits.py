"""Atomic, checksummed commits of the training state, for jobs that restart (and resize) under torchrun.

An elastic job commits its state every few optimizer steps; after a restart it resumes from the newest
commit that reads back intact, so it loses at most one commit interval. ``CommitStore`` is only the
storage layer: pure Python + torch (no torch.distributed, no lightning), one writer (rank 0) and any
number of readers.

File format (``commit-<step:08d>.pt``, little-endian)::

    offset  size  field
    0       8     magic b"LDCOMMIT"
    8       4     format version (uint32, currently 1)
    12      8     payload length in bytes (uint64)
    20      32    SHA-256 of the payload
    52      n     payload: ``torch.save(state)`` (zip format)

Why a commit is safe to trust:

- Atomic: the payload is written to a hidden temporary name (``.commit-<step>.pt.<pid>.<rand>.tmp``) in
  the same directory, fsynced, then ``os.replace``d to its final name, and the directory is fsynced.
  A half-written file never carries a final name, so a reader (or a restart after a crash at any point)
  sees either the whole commit or the previous one. Leftover temporary files are ignored by readers and
  removed by the writer's next ``save``.
- Checked: the length and SHA-256 in the header catch a truncated or damaged file at load time.
- Inert: the payload is loaded with ``torch.load(weights_only=True)``, so a payload that would run code
  when unpickled is refused, not run. ``save`` checks up front that the state holds only types that load
  this way, so an unloadable state fails on the writer at save time, not on every rank at restart.

A commit that fails any check is skipped with a ``CommitWarning`` and the previous one is used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import pickle
import random
import re
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Union, cast

import torch

from lightning_dist.checks import check_int
from lightning_dist.warn import warn_once

_MAGIC = b"LDCOMMIT"
_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, payload sha256
_FINAL = re.compile(r"commit-(\d{8,})\.pt")
_TEMP_PREFIX = ".commit-"
_TEMP_SUFFIX = ".tmp"
_RELIST_ATTEMPTS = 100

MapLocation = Union[str, torch.device, dict[str, str], Callable[..., Any], None]
"""What ``torch.load`` accepts as ``map_location`` (a device, a name, a remapping dict or a callable)."""

_SCALARS = (int, float, bool, str, type(None))
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_LEAVES = (*_SCALARS, *_TENSORS, torch.Size, torch.dtype)
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple)
_ACCEPTED = (
    "torch.Tensor (or nn.Parameter), int, float, bool, str, None, torch.Size, torch.dtype, "
    "and dict/OrderedDict/list/tuple of those (dict keys: int, float, bool, str or None)"
)


class CommitWarning(UserWarning):
    """A commit was skipped because it is truncated, damaged, or refused by weights-only loading."""


@dataclass(frozen=True)
class Commit:
    """One loaded commit: the optimizer ``step`` it was taken at, the ``state`` saved, and its ``path``."""

    step: int
    state: dict[str, Any]
    path: Path


class _Damaged(Exception):
    """A commit file that must not be used; the message says why."""


class CommitStore:
    """Atomic, checksummed training-state commits in ``dirpath``, keeping the newest ``keep``.

    ``save`` (rank 0 only: one writer per directory) writes a commit; ``load_latest`` (any process)
    returns the newest commit that reads back intact. See the module docstring for the file format.
    """

    def __init__(self, dirpath: Union[str, os.PathLike[str]], keep: int = 3) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise ValueError(f"CommitStore: dirpath={dirpath!r} must be a non-empty str or os.PathLike path")
        check_int("keep", keep, 1, owner="CommitStore")
        self._dir = Path(dirpath)
        if self._dir.exists() and not self._dir.is_dir():
            raise ValueError(f"CommitStore: dirpath={dirpath!r} must be a directory (it is a file)")
        self._keep = keep

    def __repr__(self) -> str:
        return f"CommitStore({str(self._dir)!r}, keep={self._keep})"

    @property
    def dirpath(self) -> Path:
        """The directory holding the commits (created by the first ``save``)."""
        return self._dir

    @property
    def keep(self) -> int:
        """How many of the newest commits ``save`` retains."""
        return self._keep

    def path(self, step: int) -> Path:
        """The final file name of the commit for ``step``."""
        return self._dir / f"commit-{step:08d}.pt"

    def steps(self) -> list[int]:
        """Steps of the files with a final commit name, oldest first (names only: not verified).

        Temporary files (``.commit-*.tmp``) and other names are ignored.
        """
        try:
            entries = list(os.scandir(self._dir))
        except (FileNotFoundError, NotADirectoryError):
            return []
        steps = []
        for entry in entries:
            match = _FINAL.fullmatch(entry.name)
            # only canonical names (no extra leading zeros), so that path(step) is the file listed
            if match and entry.name == self.path(int(match.group(1))).name and entry.is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> Optional[int]:
        """The newest step with a final commit name, or None (not verified: see ``load_latest``)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Commit ``state`` as of optimizer ``step`` atomically; return the commit's path.

        Raises ValueError, before writing anything, when ``state`` holds a value that
        ``torch.load(weights_only=True)`` could not read back (the message names its key path). Then
        removes all but the newest ``keep`` commits (never the one just written) and leftover temporary
        files. Saving a step that exists replaces it. Only one process may save into a directory.
        """
        check_int("step", step, 0, owner="CommitStore.save")
        _check_state(state)
        self._dir.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        temp = self._dir / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
        try:
            _write_commit(temp, state)
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                _remove(temp)
            raise
        _fsync_dir(self._dir)
        self._prune(written=step)
        return final

    def load_latest(self, map_location: MapLocation = "cpu") -> Optional[Commit]:
        """The newest commit that is intact and loads with ``weights_only=True``; None when there is none.

        Commits that are truncated, fail the checksum, or fail to load are skipped with a
        ``CommitWarning`` naming the file and the reason. ``map_location`` is passed to ``torch.load``.
        """
        skipped: set[int] = set()
        for _ in range(_RELIST_ATTEMPTS):
            vanished = False
            for step in reversed(self.steps()):
                if step in skipped:
                    continue
                path = self.path(step)
                try:
                    state = _read_commit(path, map_location)
                except FileNotFoundError:
                    # The writer pruned it after we listed: newer commits exist, so list again.
                    vanished = True
                    break
                except _Damaged as err:
                    # every rank reads the same directory (setup_environment checks): rank 0 says it
                    warn_once(f"skipping commit {path}: {err}", CommitWarning, stacklevel=2)
                    skipped.add(step)
                    continue
                return Commit(step=step, state=state, path=path)
            if not vanished:
                return None
        raise RuntimeError(
            f"commits in {self._dir} kept vanishing while being read: is more than one writer pruning it?"
        )

    def load(self, step: int, map_location: MapLocation = "cpu") -> Commit:
        """The commit of ``step`` (one another process found with ``load_latest``); ``ValueError``
        naming the file and why when it is gone or unusable."""
        path = self.path(step)
        try:
            return Commit(step=step, state=_read_commit(path, map_location), path=path)
        except (FileNotFoundError, _Damaged) as err:
            raise ValueError(f"the commit of step {step} ({path}) cannot be loaded: {err}") from err

    def _prune(self, written: int) -> None:
        steps = self.steps()
        kept = set(steps[-self._keep :]) | {written}
        for step in steps:
            if step not in kept:
                _remove(self.path(step))
        for entry in os.scandir(self._dir):
            if entry.name.startswith(_TEMP_PREFIX) and entry.name.endswith(_TEMP_SUFFIX):
                _remove(Path(entry.path))


class _HashingWriter:
    """The sink ``torch.save`` writes the payload to: passes bytes on to ``file`` and hashes them."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._file.write(view)
        self.sha256.update(view)
        self.length += len(view)
        return len(view)

    def flush(self) -> None:
        self._file.flush()


def _write_commit(temp: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to the new file ``temp`` in the commit format and fsync it."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(bytes(_HEADER.size))  # placeholder until the payload's length and hash are known
        writer = _HashingWriter(file)
        torch.save(state, cast(BinaryIO, writer))  # write + flush is all torch.save needs of a buffer
        file.seek(0)
        file.write(_HEADER.pack(_MAGIC, _VERSION, writer.length, writer.sha256.digest()))
        file.flush()
        os.fsync(file.fileno())


def _read_commit(path: Path, map_location: MapLocation) -> dict[str, Any]:
    """The state in the commit file ``path``; raises ``_Damaged`` (or FileNotFoundError) if unusable."""
    try:
        with open(path, "rb") as file:
            header = file.read(_HEADER.size)
            if len(header) < _HEADER.size:
                raise _Damaged(f"truncated: {len(header)} bytes, shorter than the {_HEADER.size}-byte header")
            magic, version, length, digest = _HEADER.unpack(header)
            if magic != _MAGIC:
                raise _Damaged(f"not a commit file (magic {magic!r}, expected {_MAGIC!r})")
            if version != _VERSION:
                raise _Damaged(f"unsupported format version {version} (this reader supports {_VERSION})")
            available = os.fstat(file.fileno()).st_size - _HEADER.size
            if available < length:  # checked before reading: a damaged length may be huge
                raise _Damaged(f"truncated: payload has {available} of {length} bytes")
            if available > length:
                raise _Damaged(f"{available - length} trailing bytes after the {length}-byte payload")
            payload = file.read(length)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise _Damaged(f"cannot be read: {err}") from err
    if len(payload) != length:  # the file changed under us (a final name is never rewritten in place)
        raise _Damaged(f"truncated: read {len(payload)} of {length} payload bytes")
    if hashlib.sha256(payload).digest() != digest:
        raise _Damaged("checksum mismatch: the payload's SHA-256 differs from the header's")
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _Damaged(f"refused by torch.load(weights_only=True): {_unpickler_reason(err)}") from err
    except Exception as err:
        raise _Damaged(f"failed to load: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict):
        raise _Damaged(f"payload is a {type(state).__name__}, not a dict")
    return state


def _unpickler_reason(err: Exception) -> str:
    """The gist of torch's long weights-only refusal (``Unsupported global: GLOBAL x.y was not ...``)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(". Please", 1)[0].strip()
    return text.splitlines()[0] if text else type(err).__name__


def _check_state(state: Any) -> None:
    """Raise ValueError unless ``state`` is a dict that ``torch.load(weights_only=True)`` reads back."""
    if type(state) not in _MAPPINGS:
        raise ValueError(f"CommitStore.save: state must be a dict, got {type(state).__name__}")
    _check_value(state, "state", set())


def _check_value(value: Any, path: str, parents: set[int]) -> None:
    kind = type(value)
    if kind in _LEAVES:
        return
    if kind not in _MAPPINGS and kind not in _SEQUENCES:
        raise ValueError(
            f"CommitStore.save: {path} is a {kind.__module__}.{kind.__qualname__}, which "
            f"torch.load(weights_only=True) cannot read back; accepted: {_ACCEPTED}"
        )
    if id(value) in parents:
        raise ValueError(f"CommitStore.save: {path} contains itself (a reference cycle)")
    parents.add(id(value))
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in _SCALARS:
                raise ValueError(
                    f"CommitStore.save: {path} has a key of type {type(key).__qualname__} ({key!r}); "
                    f"accepted: {_ACCEPTED}"
                )
            _check_value(item, f"{path}[{key!r}]", parents)
    else:
        for index, item in enumerate(value):
            _check_value(item, f"{path}[{index}]", parents)
    parents.discard(id(value))


def _remove(path: Path) -> None:
    """Delete ``path`` if it still exists."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _fsync_dir(dirpath: Path) -> None:
    """Make a rename in ``dirpath`` durable (POSIX; a no-op where directories cannot be fsynced)."""
    if os.name != "posix":
        return
    fd = os.open(dirpath, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def capture_rng_state() -> dict[str, Any]:
    """The states of python ``random``, numpy's global RNG (if importable), torch CPU and CUDA (if
    available), in types a commit accepts, for ``restore_rng_state`` to resume the same random draws."""
    states: dict[str, Any] = {"python": _python_state(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        states["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


_RNG_KEYS = ("python", "numpy", "torch", "cuda")


def restore_rng_state(states: dict[str, Any]) -> None:
    """Set the RNGs to what ``capture_rng_state`` returned; each of its keys is optional.

    A numpy state is skipped with a warning when numpy is not importable, a CUDA state when CUDA is not
    available; CUDA states are set for as many devices as both the state and this process have.
    """
    if not isinstance(states, dict):
        raise ValueError(f"restore_rng_state: states must be a dict, got {type(states).__name__}")
    unknown = sorted(set(states) - set(_RNG_KEYS), key=repr)
    if unknown:
        raise ValueError(f"restore_rng_state: unknown key(s) {unknown}; accepted: {', '.join(_RNG_KEYS)}")
    if "python" in states:
        version, internal, gauss_next = states["python"]
        random.setstate((int(version), tuple(int(x) for x in _as_list(internal)), gauss_next))
    if "numpy" in states:
        try:
            import numpy as np
        except ImportError:
            warn_once("restore_rng_state: numpy is not importable; its state is not restored", stacklevel=2)
        else:
            saved = states["numpy"]
            keys = np.asarray(_as_list(saved["keys"]), dtype=np.uint32)
            np.random.set_state(
                (
                    saved["kind"],
                    keys,
                    int(saved["pos"]),
                    int(saved["has_gauss"]),
                    float(saved["cached_gaussian"]),
                )
            )
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states:
        if torch.cuda.is_available():
            for device, state in zip(range(torch.cuda.device_count()), states["cuda"]):
                torch.cuda.set_rng_state(state.cpu(), device)
        else:
            warn_once(
                "restore_rng_state: CUDA is not available; its RNG states are not restored", stacklevel=2
            )


def _python_state(state: tuple[Any, ...]) -> tuple[int, list[int], Optional[float]]:
    version, internal, gauss_next = state
    return int(version), list(internal), gauss_next


def _as_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
