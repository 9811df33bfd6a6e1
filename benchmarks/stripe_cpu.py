"""CPU benchmark of ``kernels.stripe_conv2d`` against ``F.conv2d`` (oneDNN) with the zero-filled dense weight.

CIFAR ResNet-56 and VGG16 3x3 layer shapes at batch 64, float32, random stripe masks at keep 0.5/0.3/0.15,
NCHW and channels_last; median of repeated runs after warm-up. Writes benchmarks/results/stripe_cpu.json (or --out).

    python benchmarks/stripe_cpu.py [--repeats 7] [--batch 64] [--threads 0] [--quick] [--out PATH]

--quick (three shapes, channels_last) is a check: it writes JSON only where --out says.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's kernels
from _host import cpu_model, positive  # noqa: E402

import kernels  # noqa: E402

TOLERANCE = 1e-4  # relative error of the stripe op against F.conv2d, float32 on the CPU

SHAPES = [  # (net, C=N, H, stride)
    ("resnet56", 16, 32, 1), ("resnet56", 32, 16, 1), ("resnet56", 64, 8, 1), ("resnet56/s2", 16, 32, 2),
    ("vgg16", 64, 32, 1), ("vgg16", 128, 16, 1), ("vgg16", 256, 8, 1), ("vgg16", 512, 4, 1), ("vgg16", 512, 2, 1),
]
KEEPS = (0.5, 0.3, 0.15)


def random_layer(N, C, keep, gen, dtype=torch.float32):
    m = torch.rand(N, 3, 3, generator=gen) < keep
    nz = m.permute(1, 2, 0).nonzero()  # (kh, kw, o): canonical order
    return torch.randn(len(nz), C, generator=gen, dtype=dtype), nz[:, 2].contiguous(), nz[:, :2].contiguous()


def median_ms(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=positive(), default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--quick", action="store_true", help="first three shapes, channels_last only (a check: written "
                    "only with --out)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/stripe_cpu.json (not with --quick)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    shapes = SHAPES[:3] if args.quick else SHAPES
    layouts = ("channels_last",) if args.quick else ("nchw", "channels_last")
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, batch {args.batch}, float32; per layer the median "
          "time of stripe_conv2d and of F.conv2d on the zero-filled dense weight, x = dense / stripe time (> 1: "
          "stripes faster), model = kernels.stripe_cost's predicted stripe / dense time", flush=True)
    for net, C, H, stride in shapes:
        x0 = torch.randn(args.batch, C, H, H, generator=gen)
        for layout in layouts:
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            x = x0.contiguous(memory_format=fmt)
            for keep in KEEPS:
                w, oi, off = random_layer(C, C, keep, gen)
                plan = kernels.stripe_plan(oi, off, C, 3)
                wd = kernels.stripe_to_dense(w, oi, off, C, 3).contiguous(memory_format=fmt)
                with torch.no_grad():
                    ys = kernels.stripe_conv2d(x, w, oi, off, None, C, 3, stride, 1, 1, plan=plan)
                    yd = F.conv2d(x, wd, None, stride, 1)
                    err = ((ys - yd).norm() / yd.norm()).item()
                    s_ms = median_ms(functools.partial(kernels.stripe_conv2d, x, w, oi, off, None, C, 3, stride,
                                                       1, 1, plan=plan), args.repeats)
                    d_ms = median_ms(functools.partial(F.conv2d, x, wd, None, stride, 1), args.repeats)
                cost = kernels.stripe_cost(C, C, len(oi), 3)
                row = dict(net=net, B=args.batch, C=C, N=C, H=H, stride=stride, layout=layout, keep=keep,
                           stripes=len(oi), stripe_ms=round(s_ms, 3), dense_ms=round(d_ms, 3),
                           speedup=round(d_ms / s_ms, 2), rel_err=err, cost_model=round(cost, 3))
                rows.append(row)
                print(f"{net:12s} C={C:3d} H={H:2d} s{stride} {layout:13s} keep={keep:.2f} S={len(oi):5d} "
                      f"stripe {s_ms:8.2f} ms  dense {d_ms:8.2f} ms  x{d_ms / s_ms:5.2f}  model {cost:.2f}",
                      flush=True)
    meta = dict(device=cpu_model(), threads=torch.get_num_threads(),
                torch=torch.__version__, dtype="float32", repeats=args.repeats)
    if args.out is None and not args.quick:  # --quick is a check: never written over the committed full run
        args.out = os.path.join(os.path.dirname(__file__), "results", "stripe_cpu.json")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print("wrote", args.out)
    wrong = [f"{r['net']} {r['layout']} keep {r['keep']}" for r in rows if not r["rel_err"] <= TOLERANCE]
    if wrong:
        raise SystemExit(f"stripe_cpu.py: the stripe op differs from F.conv2d by more than {TOLERANCE} in {wrong}")


if __name__ == "__main__":
    main()
