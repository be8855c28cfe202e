"""The one-line machine description the benchmarks print above their figures."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Optional


def machine() -> str:
    """Host, OS, CPU model and core count."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} | {platform.platform()} | {cpu} | {os.cpu_count()} cores"


def plot_caption(machine_line: str, *details: str) -> str:
    """The hardware for a plot title, from a ``machine()`` line (``machine:`` prefix allowed):
    "AMD EPYC, 2 cores, CPU processes over Gloo" and then ``details`` (software, date), comma-joined."""
    fields = [f.strip() for f in machine_line.removeprefix("machine:").split("|")]
    cores = next((f for f in fields if f.endswith("cores")), "")
    model = next((f for f in fields[2:] if f != cores), "")
    return ", ".join(x for x in (model, cores, "CPU processes over Gloo", *details) if x)


def markdown_table(rows: list[tuple[str, str, str]], path: Optional[Path] = None) -> str:
    """``rows`` of (figure, measured, target) as a markdown table; also written to ``path`` when given."""
    table = "\n".join(
        ["| figure | measured | target |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    )
    if path is not None:
        path.write_text(table + "\n")
    return table
