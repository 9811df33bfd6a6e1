"""Host cost of one eager stripe-conv call on a GPU: where an eager compact model's time goes (issue 5).

A small compact CIFAR model runs eagerly at the speed the host issues kernels, not at the GPU's: this measures, per
call of one layer, the host microseconds of each way to run it, side by side in one process:

- ``cudnn``: ``F.conv2d`` with the zero-filled dense weight (what a dense model's conv costs);
- ``module_dense``: ``StripeConv2d`` in dense mode (its cached dense weight + cuDNN);
- ``module_op``: ``StripeConv2d`` in stripe mode through the op (``kernels.stripe_conv2d``: dispatch, checks,
  route choice, Triton's JIT launch), as before the module kept a launcher;
- ``module_launch``: ``StripeConv2d`` in stripe mode, eager inference as it runs now (its kept
  ``prepare_stripe_conv2d`` launcher, which launches Triton's compiled kernel directly);
- ``op``: ``kernels.stripe_conv2d`` called directly; ``launch``: the kept launcher alone.

host_us: wall time of ``calls`` back-to-back calls (no synchronisation between them) divided by ``calls``, on a
layer so small (batch 1, 8x8) that the GPU finishes each kernel before the host issues the next: the host's cost
per call. latency_us: one synchronised call on the layer at batch 256 (32x32): the host cost plus the GPU time,
what ``compress.choose_modes(timing="eager")`` measures. Median over ``repeats``; bf16, channels_last, eval,
``torch.inference_mode``. Every path's output is checked against ``F.conv2d`` (same dtype) first.

    python benchmarks/stripe_eager_gpu.py [--out benchmarks/results/stripe_eager_gpu_<gpu>.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from _host import require_cuda  # noqa: E402

import kernels  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402

# (C, N, keep): a CIFAR ResNet-56 layer (the Triton dense route with the kept weight), a 64-channel one and a
# 128-channel one (the gather route on the stripes)
LAYERS = [(16, 16, 0.5), (64, 64, 0.3), (128, 128, 0.3)]


def make_layer(C: int, N: int, keep: float, gen: torch.Generator) -> tuple[StripeConv2d, torch.Tensor]:
    conv = nn.Conv2d(C, N, 3, padding=1, bias=True)
    mask = torch.rand(N, 3, 3, generator=gen) < keep
    s = StripeConv2d.from_dense(conv, mask, mode="stripe")
    s.relu = True
    return s.cuda().to(torch.bfloat16).eval(), s.dense_weight().detach()


def paths(s: StripeConv2d, dense_w: torch.Tensor) -> dict:
    def op(x):
        return kernels.stripe_conv2d(x, s.weight, s.out_index, s.offset, s.bias, s.out_channels, 3, 1, 1, 1,
                                     relu=True, plan=s.plan, dense=s._kernel_dense_weight(x))

    dense_s = copy.deepcopy(s)
    dense_s.mode = "dense"
    op_s = copy.deepcopy(s)
    op_s._inference_launch = lambda x: None  # (an instance attribute shadows the method: always the op)
    launches: dict[tuple, object] = {}

    def launch(x):
        key = kernels.stripe_triton.input_signature(x)
        if key not in launches:
            launches[key] = kernels.prepare_stripe_conv2d(x, s.weight, s.out_index, s.offset, s.bias, s.out_channels,
                                                          3, 1, 1, 1, relu=True, plan=s.plan,
                                                          dense=s._kernel_dense_weight(x))
        return launches[key](x)

    return {
        "cudnn": lambda x: F.relu(F.conv2d(x, dense_w, s.bias, 1, 1)),
        "module_dense": dense_s,
        "module_op": op_s,
        "module_launch": s,
        "op": op,
        "launch": launch,
    }


def host_us(fn, x: torch.Tensor, calls: int, repeats: int) -> float:
    fn(x)
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        ts.append((time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def latency_us(fn, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)

    torch.backends.cudnn.benchmark = True
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for C, N, keep in LAYERS:
            s, dense_w = make_layer(C, N, keep, gen)
            dense_w = dense_w.cuda().to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
            fns = paths(s, dense_w)
            small = torch.randn(1, C, 8, 8, device="cuda", dtype=torch.bfloat16).contiguous(
                memory_format=torch.channels_last)
            big = torch.randn(256, C, 32, 32, device="cuda", dtype=torch.bfloat16).contiguous(
                memory_format=torch.channels_last)
            errors = {}
            for xx in (small, big):
                ref = F.relu(F.conv2d(xx.float(), dense_w.float(), s.bias.float(), 1, 1))
                for name, fn in fns.items():
                    err = ((fn(xx).float() - ref).norm() / ref.norm()).item()
                    errors[name] = max(errors.get(name, 0.0), err)
                    if err > 1e-2:
                        raise SystemExit(f"{name} on C={C}: relative error {err:.2e} > 1e-2")
            row = {"C": C, "N": N, "keep": keep, "stripes": s.num_stripes, "max_rel_error_bf16": errors,
                   "host_us": {}, "latency_us": {}}
            for name, fn in fns.items():
                row["host_us"][name] = round(host_us(fn, small, args.calls, args.repeats), 2)
                row["latency_us"][name] = round(latency_us(fn, big, args.repeats), 2)
            rows.append(row)
            print(f"C={C:>3} N={N:>3} keep {keep}: host us/call " + "  ".join(
                f"{k} {v:.1f}" for k, v in row["host_us"].items()) + " | latency us (batch 256) " + "  ".join(
                f"{k} {v:.1f}" for k, v in row["latency_us"].items()), flush=True)
    import triton

    result = {
        "benchmark": "host cost per eager stripe-conv call (benchmarks/stripe_eager_gpu.py)",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "dtype": "bfloat16",
        "layout": "channels_last",
        "calls": args.calls,
        "repeats": args.repeats,
        "host_input": [1, "C", 8, 8],
        "latency_input": [256, "C", 32, 32],
        "rows": rows,
    }
    out = Path(args.out) if args.out else Path(HERE) / "results" / (
        "stripe_eager_gpu_" + torch.cuda.get_device_name().split()[-1].lower() + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
