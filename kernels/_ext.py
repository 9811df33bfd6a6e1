"""Lazy loader for the CUDA extension of ``kernels`` (reusable by every op family).

``load()`` compiles the sources in ``kernels/csrc`` with ``torch.utils.cpp_extension.load`` on first use into a
cache directory (``$COMPRESS_KERNELS_CACHE`` or ``~/.cache/compress_kernels/<torch>-<cuda>``), printing one line
while it compiles. Where it cannot (no GPU, no nvcc, a compile error, or ``COMPRESS_KERNELS_NO_CUDA=1``) it
returns ``None`` after ONE clear warning, and the ops fall back to their PyTorch path (the CPU implementation,
which is device-agnostic). Other op families add their sources with ``load(name=..., sources=[...])``.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import threading
import warnings

import torch

from kernels._cpu import cache_root, env_flag

__all__ = ["CSRC", "SOURCES", "cuda_home", "load", "available", "build_dir"]

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# One extension for the op families of this file: few sources compile faster (ninja builds them in parallel).
SOURCES = ["ops.cpp", "pix.cu", "depthwise.cu", "im2col.cu"]
EXT_NAME = "compress_kernels_ext"

_lock = threading.Lock()
_cache: dict[str, object] = {}
_warned: set[str] = set()


def _has_cudart(d: str) -> bool:
    return any(os.path.exists(os.path.join(d, lib, "libcudart.so")) for lib in ("lib64", "lib"))


def cuda_home() -> str | None:
    """The CUDA toolkit root: ``$CUDA_HOME`` (or ``$CUDA_PATH``), else the directory of the real ``nvcc``
    that holds ``lib64/libcudart.so`` (wrappers on PATH are resolved past), else ``/usr/local/cuda*``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        d = os.environ.get(var)
        if d and os.path.exists(os.path.join(d, "bin", "nvcc")):
            return d
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cands += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for d in cands:
        if os.path.exists(os.path.join(d, "bin", "nvcc")) and _has_cudart(d):
            return d
    return None


def build_dir(name: str = EXT_NAME) -> str:
    root = cache_root()
    tag = f"{torch.__version__}-cu{torch.version.cuda}".replace("+", "_")
    d = os.path.join(root, tag, name)
    os.makedirs(d, exist_ok=True)
    return d


def _warn_once(name: str, why: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(
        f"compress kernels: the CUDA extension '{name}' is unavailable ({why}); "
        "CUDA tensors use the slower PyTorch fallback path.",
        RuntimeWarning,
        stacklevel=3,
    )


def load(name: str = EXT_NAME, sources: list[str] | None = None, extra_cuda_cflags: list[str] | None = None,
         verbose: bool = False, quiet: bool = False):
    """Compile (once, cached) and return the extension module, or ``None`` with one warning."""
    with _lock:
        if name in _cache:
            return _cache[name]
        mod = None
        if env_flag("COMPRESS_KERNELS_NO_CUDA"):
            _warn_once(name, "COMPRESS_KERNELS_NO_CUDA is set")
        elif not torch.cuda.is_available() or torch.version.cuda is None:
            _warn_once(name, "no CUDA GPU or a CPU-only PyTorch build")
        else:
            home = cuda_home()
            if home is None:
                _warn_once(name, "nvcc / CUDA toolkit not found; set CUDA_HOME")
            else:
                mod = _compile(name, sources or SOURCES, home, extra_cuda_cflags, verbose, quiet)
        _cache[name] = mod
        return mod


def _compile(name, sources, home, extra_cuda_cflags, verbose, quiet):
    os.environ["CUDA_HOME"] = home
    import torch.utils.cpp_extension as ce

    ce.CUDA_HOME = home
    paths = [s if os.path.isabs(s) else os.path.join(CSRC, s) for s in sources]
    bdir = build_dir(name)
    if not quiet:
        print(f"compress kernels: compiling CUDA extension '{name}' into {bdir} (first use only, ~1-3 min) ...",
              file=sys.stderr, flush=True)
    try:
        return ce.load(
            name=name,
            sources=paths,
            build_directory=bdir,
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"] + list(extra_cuda_cflags or []),
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 - any build failure means: fall back, with one warning
        _warn_once(name, f"compile failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
        return None


def available(name: str = EXT_NAME) -> bool:
    return load(name) is not None


def reset_for_tests() -> None:
    """Forget the loaded module and the warnings (tests only)."""
    with _lock:
        _cache.clear()
        _warned.clear()
