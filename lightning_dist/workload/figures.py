"""Where the notebooks write their figures and numbers: never into the checkout they came from."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

FIGURES_ENV = "LD_FIGURES_DIR"
"""The environment variable that names the folder (``scripts/execute-notebooks.py`` sets it to
``notebooks/figures`` to refresh the committed outputs)."""


def figures_dir() -> Path:
    """``$LD_FIGURES_DIR`` if set, else ``<temp dir>/lightning_dist_figures``; created if missing.

    A notebook run by a user writes its PNGs and JSON there, so running a notebook does not rewrite
    the files a checkout tracks."""
    chosen = os.environ.get(FIGURES_ENV) or os.path.join(tempfile.gettempdir(), "lightning_dist_figures")
    path = Path(chosen).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
