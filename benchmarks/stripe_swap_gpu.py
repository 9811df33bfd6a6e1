"""Route (c) (im2col) of the stripe kernel with and without SWAP, the product transposed (acc^T = W @ im2col^T, so
the pixel tile is the tensor-core instruction's wide side), on the compact VGG16's narrow layers (real SWP masks)
and CIFAR / ImageNet / ResNet-56-like 24-64-channel layers (random masks, keep 0.3), channels_last, bias + ReLU
(+ the 2x2 max-pool where VGG16 has one). Per layer: cuDNN's best dense conv (+ max_pool2d), the default config,
"plain" (the default before SWAP: its tiles without SWAP, at most 64 channels per tile, 8 warps in float32), and a
sweep of SWAP tilings; each checked against a float64 conv of the rounded operands. GPU times of CUDA-graph
replays (benchmarks/stripe_gpu.py's clock).

    python benchmarks/stripe_swap_gpu.py [--dtype bf16|fp32] [--out PATH]

float32 runs on TF32 tensor cores (operands rounded to nearest), checked to 1e-3 relative; bf16 to 1e-2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _host import require_cuda  # noqa: E402
from _masks import load_masks  # noqa: E402
from stripe_gpu import mask_layer, random_layer, time_rotated  # noqa: E402

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402

VGG_MASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "masks", "vgg16_digits.json")


def real_mask(masks: dict, name: str, N: int) -> torch.Tensor:
    """A layer's skeleton mask with its dead filters dropped, padded with empty filters to N (the compact width)."""
    m = masks[name]
    m = m[m.reshape(m.shape[0], -1).any(1)]
    return torch.cat([m, torch.zeros(N - m.shape[0], *m.shape[1:], dtype=torch.bool)])


def layers() -> list[tuple]:
    vm, _ = load_masks(VGG_MASKS)
    return [  # name, batch, C, N, H, keep or mask, pool
        ("vgg16.features.0", 256, 3, 40, 32, real_mask(vm, "features.0", 40), False),
        ("vgg16.features.3", 256, 40, 40, 32, real_mask(vm, "features.3", 40), True),
        ("vgg16.features.7", 256, 40, 64, 16, real_mask(vm, "features.7", 64), False),
        ("vgg16.features.10", 256, 64, 80, 16, real_mask(vm, "features.10", 80), True),
        ("vgg 64x32x32", 1024, 64, 64, 32, 0.3, False), ("imagenet 64x56x56", 128, 64, 64, 56, 0.3, False),
        ("24x32x32", 256, 24, 24, 32, 0.3, False), ("32x16x16", 256, 32, 32, 16, 0.3, False),
        ("48x16x16", 256, 48, 48, 16, 0.3, False), ("64x8x8", 256, 64, 64, 8, 0.3, False),
        ("cifar 64x8x8", 1024, 64, 64, 8, 0.3, False), ("cifar 32x16x16", 1024, 32, 32, 16, 0.3, False),
        ("24x16x16", 256, 24, 24, 16, 0.3, False), ("32x32x32", 256, 32, 32, 32, 0.3, False),
    ]


def candidates(default: dict, N: int, dt: torch.dtype) -> dict[str, dict]:
    cands = {"default": default}
    if default.get("SWAP"):
        # the default before SWAP: the same tiles, at most 64 channels per tile, and in float32 8 warps
        cands["plain"] = dict(default, SWAP=False, BLOCK_N=min(default["BLOCK_N"], 64),
                              num_warps=8 if dt == torch.float32 else default["num_warps"])
    else:
        cands["default swap"] = dict(default, SWAP=True)
    bns = sorted({stripe_triton._pow2(N, 16, 128), stripe_triton._pow2(N, 16, 64)})
    bks = (32,) if dt == torch.float32 else (32, 64)
    for bm, bn, bk, (nw, ns) in itertools.product((128, 256), bns, bks, ((4, 1), (4, 3), (8, 3))):
        cands[f"swap m{bm} n{bn} k{bk} w{nw} s{ns}"] = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw,
                                                           num_stages=ns, IM2COL=True, SWAP=True)
    return cands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--out", default="benchmarks/results/stripe_swap_h200.json")
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # cuDNN's side of TF32
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tol = {"bf16": 1e-2, "fp32": 1e-3}[args.dtype]  # relative error against float64 (fp32 runs in TF32)
    gen = torch.Generator().manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "layout": "channels_last",
           "timing": "median GPU ms per call, CUDA-graph replays over 3 rotated inputs", "rows": []}
    t0 = time.time()
    for name, B, C, N, H, keep, pool in layers():
        w64, oi, off = random_layer(N, C, keep, gen) if isinstance(keep, float) else mask_layer(keep, C, gen)
        keep = keep if isinstance(keep, float) else round(float(keep.float().mean()), 3)
        b64 = torch.randn(N, dtype=torch.float64, generator=gen).cuda() * 0.1
        x64 = torch.randn(B, C, H, H, dtype=torch.float64, generator=gen).cuda()
        xs = [x64.to(dt).contiguous(memory_format=torch.channels_last) for _ in range(3)]
        w, b = w64.to(dt), b64.to(dt)
        wd = kernels.stripe_to_dense(w, oi, off, N, 3, memory_format=torch.channels_last)
        ref = F.conv2d(xs[0][:4].double(), wd.double(), b.double(), 1, 1).relu()
        after = (lambda y: F.max_pool2d(y, 2)) if pool else (lambda y: y)
        ref = after(ref)
        plan = kernels.stripe_plan(oi, off, N, 3)
        row = {"layer": name, "B": B, "C": C, "N": N, "H": H, "keep": keep, "pool": pool, "S": len(oi)}
        row["cudnn_ms"] = round(min(
            time_rotated(lambda a, wd=wd, b=b, after=after: after(F.conv2d(a, wd, b, 1, 1).relu_()), xs, graph=True),
            time_rotated(lambda a, wd=wd, b=b, after=after: after(
                torch.cudnn_convolution_relu(a, wd, b, (1, 1), (1, 1), (1, 1), 1)), xs, graph=True)), 4)
        default = stripe_triton.default_config(C, N, len(oi), 9, dt, dense_given=True, pixels=B * H * H)
        row["default_config"] = default
        row["ms"] = {}
        for key, cfg in candidates(default, N, dt).items():
            try:
                launch = stripe_triton.prepare(xs[0], w, oi, off, b, plan, N, [3, 3], [1, 1], [1, 1], [1, 1], True,
                                               cfg, dense=wd, pool=pool)
                err = ((launch(xs[0])[:4].double() - ref).norm() / ref.norm()).item()
                row["ms"][key] = [round(time_rotated(launch, xs, graph=True), 4), err]
            except Exception as e:  # noqa: BLE001 - e.g. a tiling over the shared-memory limit
                row["ms"][key] = repr(e)[:160]
        timed = {k: v for k, v in row["ms"].items() if isinstance(v, list)}
        row["max_rel_error"] = max(v[1] for v in timed.values())
        row["wrong"] = sorted(k for k, v in timed.items() if not v[1] <= tol)  # never the best, however fast
        row["best"] = min(((k, v) for k, v in timed.items() if k not in row["wrong"]), key=lambda kv: kv[1][0],
                          default=None)
        base = row["ms"].get("plain", row["ms"]["default"])[0]
        row["default_speedup_over_plain"] = round(base / row["ms"]["default"][0], 3)
        print(f"{name:20s} cudnn {row['cudnn_ms']:.4f}  default {row['ms']['default'][0]:.4f} "
              f"(x{row['default_speedup_over_plain']} over plain)  best "
              + (f"{row['best'][0]} {row['best'][1][0]:.4f}" if row["best"] else "-")
              + f"  max err {row['max_rel_error']:.1e}" + (f"  WRONG: {row['wrong']}" if row["wrong"] else ""),
              flush=True)
        out["rows"].append(row)
    out["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
