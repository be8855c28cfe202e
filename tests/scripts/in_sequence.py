"""Run several test scripts' ``main``, one after another, in the same processes.

python tests/scripts/in_sequence.py '[["ddp_run.py", "--strategy", "ddp", "--out", "A"], ["metric_run.py", ...]]'
mpirun -np 2 python tests/scripts/in_sequence.py '[["hvd_train.py", ...], ["hvd_train.py", ...]]'

One launch (Lightning's, mpirun's, torchrun's) then trains several configurations: the process
start-ups, imports and process-group set-up are paid once. Lightning's launcher starts the other
ranks with this same command line, so every rank runs every configuration in the same order. Each
configuration seeds itself, as it does when its script runs alone, and its strategy counts into a
communicator of its own (counters at zero, as in a fresh process), so its results are the same.
Each run is a script next to this file (which takes its arguments as ``main(argv)``) and its arguments.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from lightning_dist import collectives


def main(runs: list[list[str]]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for script, *argv in runs:
        importlib.import_module(Path(script).stem).main(argv)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    collectives.shutdown()  # exit cleanly: no process group left to finalisation
