"""Software pipelining or not on the stripe kernel's im2col route (c) for 8-64-channel layers (issue 5).

Route (c) loads its im2col tiles with cp.async into a 3-stage shared-memory ring (num_stages 3, L2 only); with
num_stages 1 the loads are plain, L1-cached global loads and each program holds a third of the shared memory.
Layers: CIFAR VGG16 / ResNet-56 shapes (batch 256, 3x3, stride 1, random stripe masks at the keep given), bf16,
channels_last, bias + ReLU fused on both sides. Times: GPU time per call in CUDA graphs (``kernels.stripe._graph_ms``,
as ``choose_modes`` measures; L2 warm, as inside a model), against cuDNN's fused conv + bias + ReLU. Configs: the
kernel's default, the config it used before ("s3_before": route (c) with 3 stages, or route (a) up to 16 channels)
and a grid of 1-stage route (c) tilings; each output checked against the float64 conv.

    python benchmarks/stripe_narrow_stages_gpu.py [--out benchmarks/results/stripe_narrow_stages_h200.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from _host import require_cuda  # noqa: E402
from test_kernels_stripe import random_layer  # noqa: E402

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402
from kernels.stripe import _graph_ms  # noqa: E402

# (name, batch, C, H, N, keep)
LAYERS = [("vgg_40_40_32x32", 256, 40, 32, 40, 0.14), ("vgg_40_64_16x16", 256, 40, 16, 64, 0.15),
          ("vgg_64_80_16x16", 256, 64, 16, 80, 0.17), ("r56_24_32_16x16", 256, 24, 16, 32, 0.55),
          ("r56_32_24_16x16", 256, 32, 16, 24, 0.55), ("r56_48_64_8x8", 256, 48, 8, 64, 0.55),
          ("r56_64_48_8x8", 256, 64, 8, 48, 0.55), ("vgg_64_64_32x32", 256, 64, 32, 64, 0.3),
          ("r56_8_16_32x32", 256, 8, 32, 16, 0.3), ("r56_16_16_32x32", 256, 16, 32, 16, 0.5)]  # fmt: skip


def candidates(C: int, N: int) -> list[tuple[str, dict | None]]:
    bn = stripe_triton._pow2(N, 16, 64)
    before = (dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=16, CHUNK=16, num_warps=4, num_stages=3, DENSE=True, NOSKIP=True)
              if C <= 16 else dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=32 if C <= 32 else 64, CHUNK=16,
                                   num_warps=8 if C <= 32 else 4, num_stages=3, IM2COL=True))
    out = [("default", None), ("s3_before", before)]
    if C <= 16:  # route (c) pipelined, against the 1-stage grid below
        out.append(("s3_k32_w4", dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=32, CHUNK=16, num_warps=4, num_stages=3,
                                      IM2COL=True)))
    for bm, bk, nw in ((64, 32, 4), (64, 64, 4), (128, 32, 4), (128, 32, 8), (128, 64, 4), (128, 64, 8)):
        out.append((f"s1_m{bm}_k{bk}_w{nw}", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw,
                                                  num_stages=1, IM2COL=True)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "stripe_narrow_stages_h200.json"))
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, B, C, H, N, keep in LAYERS:
        w, oi, off = random_layer(N, C, (3, 3), keep, gen, dtype=torch.float32)
        w, oi, off = w.to(dev, dt), oi.to(dev), off.to(dev)
        x = torch.randn(B, C, H, H, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
        b = torch.randn(N, device=dev, dtype=dt)
        plan = kernels.stripe_plan(oi, off, N, (3, 3))
        dense = kernels.stripe_to_dense(w, oi, off, N, (3, 3), memory_format=torch.channels_last)
        ref = F.relu(F.conv2d(x.double(), dense.double(), b.double(), 1, 1))
        cudnn = partial(torch.cudnn_convolution_relu, x, dense, b, (1, 1), (1, 1), (1, 1), 1)
        row = dict(layer=name, B=B, C=C, H=H, N=N, keep=keep, cudnn_ms=round(_graph_ms(cudnn, dev, 15), 4), ms={},
                   default=stripe_triton.default_config(C, N, len(oi), 9, dt, dense_given=True, pixels=B * H * H))
        for label, cfg in candidates(C, N):
            launch = stripe_triton.prepare(x, w, oi, off, b, plan, N, [3, 3], [1, 1], [1, 1], [1, 1], True,
                                           config=cfg, dense=dense)
            err = ((launch(x).double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, label, err)
            row["ms"][label] = round(_graph_ms(partial(launch, x), dev, 15), 4)
        best = min(row["ms"], key=row["ms"].get)
        print(f"{name}: cuDNN {row['cudnn_ms']:.4f}  default {row['ms']['default']:.4f}  s3_before "
              f"{row['ms']['s3_before']:.4f}  best {best} {row['ms'][best]:.4f}", flush=True)
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": stripe_triton.triton.__version__,
            "dtype": "bf16", "layout": "channels_last", "timing": "CUDA graph of 10 calls, median of 15"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
