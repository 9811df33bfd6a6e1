"""Driver for Nsight Compute profiles of the Triton stripe kernel on three CIFAR-sized layers (batch 256, bf16,
channels_last, random masks, the dense weight kept as StripeConv2d keeps it): 40->40 and 64->64 channels at 32x32
(compact VGG16 widths) and 16->16 at 32x32 (compact ResNet-56). Each layer's kernel runs 3 times, in that order.

    python benchmarks/stripe_ncu_gpu.py                  # once, so Triton compiles outside the profile
    ncu --kernel-name regex:_stripe_fwd_kernel --launch-skip 2 --launch-count 1 --set full \\
        python benchmarks/stripe_ncu_gpu.py > results/stripe_ncu_40ch_h200.txt        # skip 5: 16ch, 8: 64ch

--skip-loop profiles the DENSE route with the per-offset skip (NOSKIP off: the kernel before the pipelined loop;
benchmarks/results/stripe_ncu_*_h200.txt were taken that way); without it, the default config.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _host import require_cuda  # noqa: E402
from stripe_gpu import random_layer  # noqa: E402

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402

LAYERS = [(40, 40, 32, 0.142), (16, 16, 32, 0.1), (64, 64, 32, 0.15)]  # (C, N, H, keep)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-loop", action="store_true", help="NOSKIP off, 2 stages (the profiled kernel)")
    args = ap.parse_args()
    require_cuda(__file__)
    gen = torch.Generator().manual_seed(0)
    for C, N, H, keep in LAYERS:
        w64, oi, off = random_layer(N, C, keep, gen)
        x = torch.randn(256, C, H, H, generator=gen).cuda().to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
        w, b = w64.to(torch.bfloat16), torch.randn(N, generator=gen).cuda().to(torch.bfloat16)
        plan = kernels.stripe_plan(oi, off, N, 3)
        dense = kernels.stripe_to_dense(w, oi, off, N, 3, memory_format=torch.channels_last)
        cfg = stripe_triton.default_config(C, N, len(oi), 9, torch.bfloat16, dense_given=True)
        if args.skip_loop:
            cfg.update(NOSKIP=False, num_stages=2)
        print(C, N, H, keep, cfg, flush=True)
        for _ in range(3):
            stripe_triton.forward(x, w, oi, off, b, plan, N, [3, 3], [1, 1], [1, 1], [1, 1], True, cfg, dense=dense)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
