#!/usr/bin/env python
"""Execute the notebooks in place, so that the committed notebooks carry fresh outputs.

    python scripts/execute-notebooks.py                       # all of notebooks/*.ipynb
    python scripts/execute-notebooks.py 00_which_strategy     # or those named (stem or path)

Each notebook runs top to bottom in a fresh kernel with nbclient (cwd notebooks/, at most 300 s a
cell, one thread per process, Open MPI allowed to run as root for Horovod's mpirun). Its figures and
its numbers (``<stem>.json``) go to notebooks/figures/ (or to $LD_FIGURES_DIR where that is set). The notebook is written back with its
outputs and, in ``metadata["lightning_dist"]["code_sha256"]``, the sha256 of its code cells'
sources concatenated: tests/test_notebooks.py recomputes it and fails on a notebook whose code
changed since it was executed. A notebook that fails is left as it was; the script then exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 300
"""Seconds any one cell may run."""


def code_sha256(nb: nbformat.NotebookNode) -> str:
    """The sha256 of the code cells' sources, concatenated in order (what the freshness test checks)."""
    sources = "".join(c.source for c in nb.cells if c.cell_type == "code")
    return hashlib.sha256(sources.encode("utf-8")).hexdigest()


def notebook_paths(names: list[str]) -> list[Path]:
    if not names:
        return sorted(NOTEBOOKS.glob("*.ipynb"))
    paths = []
    for name in names:
        path = Path(name)
        if not path.suffix:
            path = NOTEBOOKS / f"{name}.ipynb"
        if not path.is_file():
            sys.exit(f"no notebook {name}: give a stem such as 00_which_strategy or a path to an .ipynb")
        paths.append(path.resolve())
    return paths


def environment() -> None:
    """The kernels inherit this process's environment."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    os.environ["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    os.environ.setdefault("LD_FIGURES_DIR", str(NOTEBOOKS / "figures"))  # the committed figures, unless set
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        record_timing=False,  # no timestamps in the committed file
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first error
    nb.metadata.setdefault("lightning_dist", {})["code_sha256"] = code_sha256(nb)
    nbformat.write(nb, path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description="Execute the notebooks in place (outputs and code hash written back)."
    )
    parser.add_argument(
        "notebooks", nargs="*", help="stems (00_which_strategy) or paths; default: every notebooks/*.ipynb"
    )
    paths = notebook_paths(parser.parse_args(argv).notebooks)
    environment()
    failed = []
    start_all = time.monotonic()
    for i, path in enumerate(paths, 1):
        start = time.monotonic()
        try:
            execute(path)
        except Exception as err:  # report, leave the notebook as it was, go on with the next
            failed.append(path.name)
            print(
                f"[{i}/{len(paths)}] {path.name}: FAILED after {time.monotonic() - start:.0f} s\n{err}",
                flush=True,
            )
            continue
        print(f"[{i}/{len(paths)}] {path.name}: executed in {time.monotonic() - start:.0f} s", flush=True)
    print(
        f"{len(paths) - len(failed)} of {len(paths)} notebooks executed in {time.monotonic() - start_all:.0f} s"
    )
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
