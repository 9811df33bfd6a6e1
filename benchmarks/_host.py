"""The machine a benchmark runs on: the CPU's name and which CPU kernels ran, for a CPU benchmark's JSON
(compact_cpu.py, pix_cpu.py, ...), and the check the GPU benchmarks start with."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch


def require_cuda(script: str) -> None:
    """Exit with a message naming `script` (its path) when this machine has no CUDA device."""
    if not torch.cuda.is_available():
        sys.exit(f"{Path(script).name} times GPU kernels and needs a CUDA device; none was found here")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (e.g. 'Intel(R) Xeon(R) Processor'), else platform's guess."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else (platform.processor() or platform.machine())


def cpu_kernels() -> str:
    """Which CPU path "ours" took: "C++" (kernels/_cpu.py's library) or "PyTorch" (COMPRESS_KERNELS_NO_CPU set, or
    the library could not be built: then "ours" is PyTorch's own path, and a speedup against it means nothing)."""
    from kernels import _cpu

    return "C++" if _cpu.lib() is not None else "PyTorch"


def positive(kind: type = int):
    """An argparse type: a number > 0 of `kind` (a repeat count of 0 failed after the models were built)."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise ValueError(text)
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse
