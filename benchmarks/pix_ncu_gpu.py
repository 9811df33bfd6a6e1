"""Runs the PiX CUDA kernels once each, for tools that wrap a process (Nsight Compute, compute-sanitizer).

Default: bf16 64x2048x7x7 NCHW forward, a same-size copy kernel and the backward, after warm-up (the shapes of
``benchmarks/results/ncu_pix_stage_nchw7x7_bf16_h200.txt``):

    ncu --launch-skip 9 --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \\
        python benchmarks/pix_ncu_gpu.py

``--paths``: every PiX kernel path of the 16-bit types once (warp-staged NCHW for 8-plane chunks, the per-plane
NCHW kernels, channels_last with dp written by the backward kernel; pix and pix_squeeze, forward and backward),
for ``compute-sanitizer --tool memcheck python benchmarks/pix_ncu_gpu.py --paths``
(``benchmarks/results/sanitizer_pix_h200.txt``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _host import require_cuda  # noqa: E402

import kernels  # noqa: E402
from kernels import _ext  # noqa: E402


def profile_shapes() -> None:
    ops = torch.ops.compress
    B, C, H, z = 64, 2048, 7, 4
    x = torch.randn(B, C, H, H, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(B, C // z, 1, 1, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(B, C // z, H, H, device="cuda", dtype=torch.bfloat16)
    n = (x.numel() + dy.numel()) * 2 // 8  # float32 elements per direction: the forward's bytes
    a, b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    for _ in range(4):  # 3 warm-up rounds, then the profiled one (launches 9-11)
        ops.pix(x, p, z, 0.5)
        torch.mul(a, 1.0, out=b)
        ops.pix_backward(dy, x, p, z, 0.5)
    torch.cuda.synchronize()


def all_paths() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = ((3, 64, 7, 4, torch.contiguous_format),  # 48 planes: warp-staged
             (2, 40, 5, 1, torch.contiguous_format),  # 80 planes, zeta 1: warp-staged
             (3, 36, 7, 4, torch.contiguous_format),  # 27 planes: per-plane kernels
             (2 * sms + 1, 32, 7, 4, torch.channels_last))  # dp written by the backward kernel
    for dtype in (torch.bfloat16, torch.float16):
        for B, C, H, z, fmt in cases:
            x = torch.randn(B, C, H, H, device="cuda", dtype=dtype).contiguous(memory_format=fmt).requires_grad_(True)
            p = torch.rand(B, C // z, 1, 1, device="cuda", dtype=dtype).requires_grad_(True)
            y = kernels.pix(x, p, z)
            torch.autograd.grad(y, (x, p), torch.randn_like(y))
            w = (torch.randn(C // z, C, 1, 1, device="cuda") * 0.1).requires_grad_(True)
            y = kernels.pix_squeeze(x, w, z)
            torch.autograd.grad(y, (x, w), torch.randn_like(y))
    torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paths", action="store_true", help="run every 16-bit kernel path once (for compute-sanitizer)")
    args = ap.parse_args()
    require_cuda(__file__)
    if _ext.load() is None:
        sys.exit("pix_ncu_gpu.py: the CUDA extension did not build (see the messages above)")
    if args.paths:
        all_paths()
    else:
        profile_shapes()
    print("pix_ncu_gpu: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
