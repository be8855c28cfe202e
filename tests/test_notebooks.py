"""Every notebook runs top to bottom in a fresh kernel (its own asserts check the results)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow
NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "horovod" in path.read_text():
        pytest.importorskip("horovod.torch", reason="horovod not built: run scripts/install-horovod.sh")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(path.parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
