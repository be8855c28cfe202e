"""Run several test scripts' ``main``, one after another, in the same processes.

python tests/scripts/in_sequence.py '[["ddp_run.py", "--strategy", "ddp", "--out", "A"], ["metric_run.py", ...]]'
mpirun -np 2 python tests/scripts/in_sequence.py '[["hvd_train.py", ...], ["hvd_train.py", ...]]'

One launch (Lightning's, mpirun's, torchrun's) then trains several configurations: the process
start-ups, imports and process-group set-up are paid once. Lightning's launcher starts the other
ranks with this same command line, so every rank runs every configuration in the same order. Each
configuration seeds itself, as it does when its script runs alone, and its strategy counts into a
communicator of its own (counters at zero, as in a fresh process), so its results are the same.
Each run is a script (a file next to this one, or a path) whose ``main(argv)`` takes the arguments,
and its arguments.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

from lightning_dist import collectives

HERE = Path(__file__).resolve().parent


def load(script: str) -> ModuleType:
    """The module of ``script``: a file of tests/scripts (by name or path), else the file at that path."""
    path = Path(script)
    if os.sep not in script or path.resolve().parent == HERE:
        return importlib.import_module(path.stem)
    sys.path.insert(0, str(path.resolve().parent))  # its neighbours import, as when it runs as a script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, script
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(runs: list[list[str]]) -> None:
    sys.path.insert(0, str(HERE))
    modules: dict[str, ModuleType] = {}
    for script, *argv in runs:
        if script not in modules:
            modules[script] = load(script)
        modules[script].main(argv)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
