"""The machine a CPU benchmark ran on, for its JSON (shared by compact_cpu.py and pix_cpu.py)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (e.g. 'Intel(R) Xeon(R) Processor'), else platform's guess."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else (platform.processor() or platform.machine())
