"""Every notebook runs top to bottom in a fresh kernel on CPU (2 processes); its own asserts check the
results against a reference (Lightning's DDP, the uncompressed run, gradient-space Adasum, the
fault-free run). The committed notebooks carry no outputs.

Measured on a 2-core VM: 00 about 45 s, 01 about 18 s, 02 about 37 s, 03 about 8 s (about 2 min in all).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 180
"""Seconds any one cell may run (the longest, 00's six fork-launched trainings, takes about 35 s)."""


def test_there_are_notebooks() -> None:
    names = {p.stem for p in NOTEBOOKS}
    assert {"00_which_strategy", "01_ddp_and_compression", "02_horovod_adasum", "03_elastic"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path: Path) -> None:
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), (
        f"{path.name} has outputs: strip them before committing"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if "horovod" in path.stem:
        pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LD_FIGURES_DIR", str(tmp_path / "figures"))  # not the committed figures
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(path.parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first error
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
