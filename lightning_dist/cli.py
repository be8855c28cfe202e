"""`lightning-dist` command: demo, env check, slurm (sbatch scripts)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def _env() -> int:
    """One line per item: its name, then its version or path (or why it is missing)."""
    import platform
    import shutil

    import lightning
    import torch

    def line(name: str, value: str) -> None:
        print(f"{name:<11} {value}")

    line("python", platform.python_version())
    line("torch", f"{torch.__version__} (cuda available: {torch.cuda.is_available()})")
    line("lightning", lightning.__version__)
    for backend, available in (
        ("gloo", torch.distributed.is_gloo_available()),
        ("nccl", torch.distributed.is_nccl_available()),
    ):
        line(backend, "available" if available else "not available")
    try:
        import horovod

        line("horovod", horovod.__version__)
    except ImportError:
        line("horovod", "not installed (scripts/install-horovod.sh builds it against this torch)")
    for tool in ("mpirun", "horovodrun", "torchrun", "srun", "sbatch"):
        line(tool, shutil.which(tool) or "not found")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-dist")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the embedded workload with every strategy, print a table")
    demo.add_argument("--steps", type=int, default=100)
    demo.add_argument(
        "--cap-mbit",
        type=float,
        default=100.0,
        help="as root: add a column of step times across 2 emulated nodes at this link cap (0: off)",
    )
    sub.add_parser("env", help="print versions and which launchers/backends are available")
    from lightning_dist.launch.slurm import add_parser as add_slurm_parser

    add_slurm_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["slurm"]:
        # everything after the first `--` is the training command, whatever its flags
        cut = argv.index("--") if "--" in argv else len(argv)
        args = parser.parse_args(argv[:cut])
        from lightning_dist.launch.slurm import run as slurm_run

        return slurm_run(args, argv[cut + 1 :])
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":
        from lightning_dist.workload.demo import main as demo_main

        return demo_main(args.steps, extra, args.cap_mbit)
    return _env()


if __name__ == "__main__":
    sys.exit(main())
