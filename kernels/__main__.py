"""``python -m kernels build``: compile (and cache) the C++ CPU kernels and, where a GPU and nvcc are present, the
CUDA extension now (e.g. while building a container image whose cache is read-only at run time); exits 0 when all
that this machine can build is built (the CUDA extension is skipped, with its warning, without a GPU).
``python -m kernels check-compile``: compile every source in kernels/csrc to an object file with nvcc, in
parallel, without a GPU (CI runs it where nvcc exists); exits non-zero on the first error."""

from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

from kernels import _ext


def _arch_flags() -> list[str]:
    """nvcc -gencode flags for TORCH_CUDA_ARCH_LIST (compute capabilities such as "8.0;9.0a", "+PTX" adding the
    PTX; unset or empty: 9.0). SystemExit naming the entry for anything else (a name such as "Hopper")."""
    archs = (os.environ.get("TORCH_CUDA_ARCH_LIST") or "9.0").replace(",", ";").replace(" ", ";")
    flags = []
    for a in filter(None, archs.split(";")):
        num = a.removesuffix("+PTX").replace(".", "")
        if not re.fullmatch(r"\d{2,}[af]?", num):
            raise SystemExit(f"check-compile: TORCH_CUDA_ARCH_LIST entry {a!r} is not a compute capability; give "
                             "numbers such as 8.0;9.0 (optionally with a, f or +PTX)")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if a.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def check_compile() -> int:
    import torch
    import torch.utils.cpp_extension as ce

    home = _ext.cuda_home()
    if home is None:
        print("check-compile: no CUDA toolkit found (set CUDA_HOME)", file=sys.stderr)
        return 2
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        incs = ce.include_paths(device_type="cuda")
    except TypeError:  # older torch
        incs = ce.include_paths(cuda=True)
    # CUDA headers from pip wheels (cusparse etc.) when the toolkit lacks them
    site = os.path.dirname(os.path.dirname(torch.__file__))
    wheel_incs = sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    incs = [i for i in incs if os.path.isdir(i)] + [os.path.join(home, "include")] + wheel_incs
    incs.append(sysconfig.get_paths()["include"])
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    with open(ce.__file__) as f:  # the C++ standard this torch's extensions are built with
        std = "c++20" if "-std=c++20" in f.read() else "c++17"
    common = [f"-std={std}", "-O1", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={_ext.EXT_NAME}",
              "-DTORCH_API_INCLUDE_EXTENSION_H", "-Xcompiler", "-fPIC"] + [f"-I{i}" for i in incs]
    cu_flags = list(getattr(ce, "COMMON_NVCC_FLAGS", [])) + _arch_flags()
    procs = []
    t0 = time.time()
    rc = 0
    print(f"check-compile: compiling {len(_ext.SOURCES)} sources with {nvcc}, in parallel (a minute or more on a "
          "few cores)", flush=True)
    # a kill (timeout's SIGTERM) unwinds too, so the nvcc processes stop and their temporary folder goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="compress_check_") as out:  # objects and nvcc's own temporaries
        env = {**os.environ, "TMPDIR": out}
        try:
            for src in _ext.SOURCES:
                path = os.path.join(_ext.CSRC, src)
                cmd = [nvcc, "-c", path, "-o", os.path.join(out, src + ".o")] + common
                if src.endswith(".cu"):
                    cmd += cu_flags
                procs.append((src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True, env=env)))
            for src, p in procs:
                log, _ = p.communicate()
                status = "ok" if p.returncode == 0 else f"FAILED ({p.returncode})"
                print(f"check-compile: {src}: {status} ({time.time() - t0:.0f}s)", flush=True)
                if p.returncode != 0:
                    rc = 1
                    print(log[-6000:])
        finally:
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    print(f"check-compile: {len(procs)} sources with {nvcc} in {time.time() - t0:.0f}s -> {'ok' if rc == 0 else 'FAILED'}")
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="command")
    build = sub.add_parser("build", help="compile and cache the C++ CPU kernels and the CUDA extension (the latter "
                                         "needs a GPU and nvcc)")
    build.add_argument("-v", "--verbose", action="store_true", help="show the CUDA compiler's commands and output")
    sub.add_parser("check-compile", help="compile the CUDA sources to object files with nvcc only (no GPU)")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return build_all(args.verbose)
    return check_compile()


def build_all(verbose: bool = False) -> int:
    """`build`: 0 when the CPU library (unless COMPRESS_KERNELS_NO_CPU) and, on a machine with a CUDA GPU (unless
    COMPRESS_KERNELS_NO_CUDA), the CUDA extension are built and load; 1 otherwise (the warnings say why)."""
    import torch

    from kernels import _cpu

    rc = 0
    if _cpu.env_flag("COMPRESS_KERNELS_NO_CPU"):
        print("build: C++ CPU kernels skipped (COMPRESS_KERNELS_NO_CPU is set)")
    else:
        ok = _cpu.lib() is not None
        print("build: C++ CPU kernels", "ok" if ok else "unavailable (see the warning above)")
        rc |= not ok
    no_cuda = _cpu.env_flag("COMPRESS_KERNELS_NO_CUDA")  # (its value checked on any machine)
    gpu = torch.cuda.is_available() and torch.version.cuda is not None
    if not gpu or no_cuda:
        print("build: CUDA extension skipped (" + ("COMPRESS_KERNELS_NO_CUDA is set" if gpu
                                                     else "no CUDA GPU or a CPU-only PyTorch build") + ")")
    else:
        ok = _ext.load(verbose=verbose) is not None
        print("build: CUDA extension", "ok" if ok else "unavailable (see the warning above)")
        rc |= not ok
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
