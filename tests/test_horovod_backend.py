"""HorovodBackend and Adasum against Horovod's MPI Adasum, under ``mpirun -np 2`` and ``-np 4``.

One run of ``tests/scripts/hvd_check.py`` per world size (module-scoped) computes, in the same
processes, Horovod's Adasum, lightning_dist's Adasum over a Gloo group, and the HorovodBackend
collectives; the tests read its per-rank results. Skipped only when horovod or mpirun is missing.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import SCRIPTS, mpirun_ranks, run_command

from lightning_dist.collectives.horovod_backend import HorovodBackend, import_horovod

SCRIPT = SCRIPTS / "hvd_check.py"
TIMEOUT_S = 240
"""Seconds for one mpirun of the check script (the `mpi_results` fixture, once per np, in the first
test that asks for it): those tests are marked `@pytest.mark.timeout(2 * TIMEOUT_S)`."""


def _horovod_missing() -> str | None:
    if importlib.util.find_spec("horovod") is None or importlib.util.find_spec("horovod.torch") is None:
        return "horovod is not installed (scripts/install-horovod.sh builds it)"
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"
    return None


def run_mpirun(np: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run the check script on ``np`` ranks (``run_command``: the whole process group killed on timeout)."""
    cmd = [*mpirun_ranks(np), "-x", "HVD_CHECK_OUT", sys.executable, str(SCRIPT)]
    proc = run_command(cmd, TIMEOUT_S, OMP_NUM_THREADS="1", HVD_CHECK_OUT=str(out_dir))
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"mpirun -np {np} failed ({proc.returncode})\n{out[-3000:]}\n{err[-5000:]}"
    results = [json.loads(f.read_text()) for f in sorted(out_dir.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == list(range(np)), f"missing ranks in output:\n{out}\n{err}"
    return sorted(results, key=lambda r: r["rank"])


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"np{n}")
def mpi_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    reason = _horovod_missing()
    if reason:
        pytest.skip(reason)
    return run_mpirun(request.param, tmp_path_factory.mktemp(f"hvd_check_np{request.param}"))


@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_adasum_matches_horovod_mpi_adasum(mpi_results: list[dict[str, Any]]) -> None:
    for result in mpi_results:
        errs = result["adasum"]
        assert errs["ours_vs_horovod"] < 1e-5, errs
        assert errs["ours_vs_reference"] < 1e-5, errs
        assert errs["horovod_vs_reference"] < 1e-5, errs
        assert errs["native_vs_horovod"] == 0.0, "HorovodBackend.native_adasum is hvd.Adasum itself"


@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_horovod_backend_collectives(mpi_results: list[dict[str, Any]]) -> None:
    for result in mpi_results:
        failed = [name for name, ok in result["backend"].items() if not ok]
        assert not failed, f"rank {result['rank']} of {result['size']}: {failed}"
        assert len(result["backend"]) >= 22


def test_missing_horovod_points_to_install_script(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    with pytest.raises(ImportError, match="scripts/install-horovod.sh"):
        import_horovod()
    with pytest.raises(ImportError, match="scripts/install-horovod.sh"):
        HorovodBackend()


def _fake_backend(**hvd: Any) -> HorovodBackend:
    """A HorovodBackend over a stand-in ``hvd`` (no Horovod job needed for the checks)."""
    backend = HorovodBackend.__new__(HorovodBackend)
    defaults = dict(mpi_built=True, mpi_enabled=True, nccl_built=False, size=2, local_size=2)
    defaults.update(hvd)
    backend.hvd = SimpleNamespace(**{k: (lambda v=v: v) for k, v in defaults.items()})
    return backend


def test_check_adasum_errors_say_what_to_change() -> None:
    _fake_backend().check_adasum()
    with pytest.raises(RuntimeError, match="built without"):
        _fake_backend(mpi_built=False).check_adasum()
    with pytest.raises(RuntimeError, match="horovodrun --mpi"):
        _fake_backend(mpi_enabled=False).check_adasum()
    with pytest.raises(ValueError, match="power-of-two world size; got 3.*reduce_op='adasum'"):
        _fake_backend(size=3).check_adasum()
    with pytest.raises(ValueError, match="power-of-two number of nodes; got 3"):
        _fake_backend(nccl_built=True, size=6, local_size=2).check_adasum("cuda")
    _fake_backend(nccl_built=True, size=6, local_size=3).check_adasum("cuda")
