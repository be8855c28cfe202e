"""GPU check of Elastic: world size 1 over NCCL under torchrun commits, is SIGKILLed, resumes.

    python scripts/gpu_elastic_check.py OUT_DIR

Runs tests/scripts/elastic_run.py twice on the GPU (``--accelerator gpu``, commits every 3 steps,
12 steps): fault-free, and with the worker SIGKILLed after step 7 (``--max-restarts=1``). Passes when
the second run resumed from the commit of step 6 and its final weights equal the fault-free run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def torchrun(out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "--max-restarts=1", str(REPO / "tests/scripts/elastic_run.py"), "--out", str(out),
           "--accelerator", "gpu", "--commit-every", "3", "--max-steps", "12", *args]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests/scripts")]),
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # the script fits with deterministic=True
    }
    print("$", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=300)


def main() -> int:
    root = Path(sys.argv[1])
    torchrun(root / "fault_free")
    torchrun(root / "killed", "--kill-rank", "0", "--kill-step", "7")
    facts = json.loads((root / "killed" / "rank0.json").read_text())
    a, b = torch.load(root / "killed" / "rank0.pt"), torch.load(root / "fault_free" / "rank0.pt")
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    ok = facts["attempt"] == 1 and facts["resumed_from"] == 6 and facts["global_step"] == 12 and diff <= 1e-6
    print(
        f"{'PASS' if ok else 'FAIL'} elastic nccl world 1: {facts}; max abs weight diff {diff:.3g}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
