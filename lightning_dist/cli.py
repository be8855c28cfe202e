"""`lightning-dist` command: demo, strategies, env check, slurm (sbatch scripts), install-horovod."""

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
        print(f"{name:<14} {value}")

    from lightning_dist import __version__

    line("lightning-dist", __version__)
    line("tested", _tested())
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
        line("horovod", "not installed (`lightning-dist install-horovod` builds it against this torch)")
    for tool in ("mpirun", "horovodrun", "torchrun", "srun", "sbatch"):
        line(tool, shutil.which(tool) or "not found")
    return 0


def _tested() -> str:
    """The minor versions the test suite ran on, e.g. ``python 3.11.x; torch 2.11.x, 2.13.x; ...``."""
    from lightning_dist.compat import TESTED

    return "; ".join(f"{name} {', '.join(v + '.x' for v in versions)}" for name, versions in TESTED.items())


def _installed() -> str:
    """The installed versions of what ``TESTED`` names, each marked when its minor version is untested."""
    import importlib.metadata
    import platform

    from lightning_dist.compat import TESTED

    found = []
    for name, minors in TESTED.items():
        try:
            version = platform.python_version() if name == "python" else importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
            continue
        minor = ".".join(version.split("+")[0].split(".")[:2])
        found.append(f"{name} {version}" + ("" if minor in minors else " (untested)"))
    return ", ".join(found)


def _version() -> str:
    from lightning_dist import __version__

    return f"lightning-dist {__version__} (tested with {_tested()})\ninstalled: {_installed()}"


def _strategies() -> int:
    """Every strategy name the pack registers, with its description (deprecated aliases last)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401  (registers the names)
    from lightning_dist.strategies.registry import pack_names

    names = pack_names(StrategyRegistry)
    width = max(map(len, names))
    print(f"{'name':<{width}}  description   (use: Trainer(strategy=NAME))")
    for name, description in names.items():
        print(f"{name:<{width}}  {description}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-dist", description="Distributed-training strategies for PyTorch Lightning."
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the version, the tested and the installed python/torch/lightning/torchmetrics versions",
    )
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
    sub.add_parser("strategies", help="list every strategy name the pack registers, with a description")
    from lightning_dist.install_horovod import add_parser as add_install_horovod_parser
    from lightning_dist.launch.slurm import add_parser as add_slurm_parser

    add_slurm_parser(sub)
    add_install_horovod_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(_version())
        return 0
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
    if args.command == "strategies":
        return _strategies()
    if args.command == "install-horovod":
        from lightning_dist.install_horovod import run as install_horovod

        return install_horovod(parser.parse_args(argv))  # its own options only: no extra arguments
    return _env()


if __name__ == "__main__":
    sys.exit(main())
