"""The command-line options the fit benchmarks share (``bench_elastic``, ``bench_live_recovery``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def fit_parser(doc: str, rounds_help: str) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--steps``, ``--warmup``, ``--rounds``
    (``rounds_help``: what a round is) and ``--table``; each benchmark adds its own options."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per fit")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each fit left out of its mean")
    p.add_argument("--rounds", type=int, default=3, help=rounds_help)
    p.add_argument("--table", type=Path, default=None, help="also write the markdown table(s) here")
    return p
