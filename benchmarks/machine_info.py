"""The one-line machine description the benchmarks print above their figures."""

from __future__ import annotations

import os
import platform
from pathlib import Path


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
