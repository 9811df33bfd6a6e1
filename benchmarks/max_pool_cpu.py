"""CPU max-pool: kernels.max_pool2d (the C++ NCHW kernel) against PyTorch's F.max_pool2d on the same NCHW tensor
and on its channels_last copy, fp32, inference, interleaved calls, median of the repeats.

Shapes: ResNet-50's stem pool (3x3, stride 2, padding 1) at batch 1 and 8, and CIFAR VGG16's 2x2 pools at
batch 64 (the widths of the dense model).

    python benchmarks/max_pool_cpu.py [--threads 2] [--repeats 50] [--out benchmarks/results/max_pool_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from _host import cpu_kernels, cpu_model, positive  # noqa: E402

from kernels.pool import max_pool2d  # noqa: E402

SHAPES = [  # (name, input shape, kernel, stride, padding)
    ("resnet50 stem, batch 1", (1, 64, 112, 112), 3, 2, 1),
    ("resnet50 stem, batch 8", (8, 64, 112, 112), 3, 2, 1),
    ("vgg16 pool 1, batch 64", (64, 64, 32, 32), 2, 2, 0),
    ("vgg16 pool 2, batch 64", (64, 128, 16, 16), 2, 2, 0),
    ("vgg16 pool 3, batch 64", (64, 256, 8, 8), 2, 2, 0),
    ("vgg16 pool 4, batch 64", (64, 512, 4, 4), 2, 2, 0),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=positive(), default=2)
    ap.add_argument("--repeats", type=positive(), default=50)
    ap.add_argument("--out", default=str(Path(HERE) / "results" / "max_pool_cpu.json"))
    args = ap.parse_args()
    if cpu_kernels() != "C++":  # "ours" would be F.max_pool2d itself, checked against itself
        sys.exit("max_pool_cpu.py times the C++ max-pool, which is off here (COMPRESS_KERNELS_NO_CPU, or the library "
                 "did not build: see the warning above)")
    torch.set_num_threads(args.threads)
    rows = []
    with torch.inference_mode():
        for name, shape, k, s, p in SHAPES:
            x = torch.randn(shape)
            cl = x.contiguous(memory_format=torch.channels_last)
            calls = {"aten_nchw": (F.max_pool2d, x), "ours_nchw": (max_pool2d, x),
                     "aten_channels_last": (F.max_pool2d, cl)}
            assert torch.equal(max_pool2d(x, k, s, p), F.max_pool2d(x, k, s, p))
            times = {c: [] for c in calls}
            for _ in range(3):
                for f, t in calls.values():
                    f(t, k, s, p)
            for _ in range(args.repeats):
                for c, (f, t) in calls.items():
                    t0 = time.perf_counter()
                    f(t, k, s, p)
                    times[c].append((time.perf_counter() - t0) * 1e3)
            ms = {c: round(statistics.median(v), 4) for c, v in times.items()}
            row = {"shape": name, "input": list(shape), "kernel": k, "stride": s, "padding": p, "ms": ms,
                   "speedup_vs_aten_nchw": round(ms["aten_nchw"] / ms["ours_nchw"], 2)}
            rows.append(row)
            print(f"{name:<24} aten NCHW {ms['aten_nchw']:8.3f} ms  ours {ms['ours_nchw']:8.3f} ms  "
                  f"aten channels_last {ms['aten_channels_last']:8.3f} ms  -> {row['speedup_vs_aten_nchw']:.1f}x")
    result = {"benchmark": "CPU max-pool, fp32 inference", "threads": torch.get_num_threads(), "cpu": cpu_model(),
              "torch": torch.__version__, "repeats": args.repeats,
              "statistic": "median ms per call, the three calls interleaved", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
