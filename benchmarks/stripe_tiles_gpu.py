"""Tile sweep of the Triton stripe kernel on narrow layers, in CUDA graphs (GPU time, as `choose_modes` measures).

For ResNet-56-like compact layers (C -> N channels, 3x3, stride 1, batch 256, bf16, channels_last, random masks,
bias + fused ReLU) it times cuDNN (F.conv2d, and torch.cudnn_convolution_relu with the bias and ReLU fused), the
kernel's default config with the DENSE route's weight built per call and kept (``dense=``), and a grid of tilings
of the DENSE ("D") and one-hot ("O") routes, each checked against float64 (relative error < 1e-2). It is the
measurement behind ``kernels.stripe_triton.default_config``'s DENSE route up to 64 channels when the weight is kept
(benchmarks/results/stripe_tiles_narrow_h200.json; its "default" columns are the defaults before that change).

--set vgg16 takes the first layers of the compact CIFAR VGG16s instead (3-128 channels at 8x8-32x32, real and random
masks) and a wider grid: BLOCK_N 16/32/64 and BLOCK_K 16 or the whole width, at three (BLOCK_M, warps).

--set noskip: the DENSE route with the kept weight over every offset without the per-offset skip ("N", a loop that
Triton can software-pipeline) at 2-4 stages, against the skipping DENSE route, on 16-80-channel layers.

    python benchmarks/stripe_tiles_gpu.py [--set narrow|vgg16|noskip] [--out results/stripe_tiles_<set>_<gpu>.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from _host import require_cuda  # noqa: E402
from stripe_gpu import random_layer  # noqa: E402

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402
from kernels.stripe import _graph_ms, stripe_to_dense  # noqa: E402

BATCH = 256
SHAPES = [  # (C, N, H, keep): the widths and keeps of the real-mask compact ResNet-56
    (3, 16, 32, 0.07), (16, 8, 32, 0.12), (8, 16, 32, 0.1), (16, 16, 32, 0.1), (16, 16, 32, 0.5),
    (8, 32, 16, 0.03), (32, 16, 16, 0.1), (32, 8, 16, 0.1), (16, 32, 16, 0.05), (24, 32, 16, 0.09),
    (32, 32, 16, 0.3), (64, 64, 8, 0.1),
]
VGG16_SHAPES = [  # (C, N, H, keep): compact VGG16 layers, real masks then random
    (3, 40, 32, 0.117), (40, 40, 32, 0.142), (40, 64, 16, 0.153), (64, 80, 16, 0.171), (80, 128, 8, 0.155),
    (3, 48, 32, 0.52), (48, 48, 32, 0.52),
]
NOSKIP_SHAPES = [
    (40, 40, 32, 0.142), (64, 64, 32, 0.15), (48, 48, 32, 0.52), (32, 32, 16, 0.3), (16, 16, 32, 0.1),
    (64, 64, 8, 0.1), (64, 80, 16, 0.171), (3, 40, 32, 0.117), (8, 16, 32, 0.1),
]
TILES = [(64, 2, 2), (64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 4, 3), (128, 8, 2),
         (256, 4, 2), (256, 8, 1), (256, 8, 2), (256, 8, 3)]  # (BLOCK_M, num_warps, num_stages)


def grid(C, N, kind):
    """(name, config) of the tilings `kind` ("narrow", "vgg16", "noskip") times: DENSE ("D"), one-hot ("O") and
    non-skipping DENSE ("N") routes."""
    bk, bn = stripe_triton._pow2(C, 16, 128), stripe_triton._pow2(N, 16, 64)
    if kind == "noskip":
        bn = 16 if C <= 4 else bn
        return [(f"{'N' if noskip else 'D'} m{bm} w{nw} s{ns}",
                 dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=ns, DENSE=True,
                      NOSKIP=noskip))
                for noskip in (True, False)
                for bm, nw, ns in [(128, 4, 2), (128, 4, 3), (128, 4, 4), (64, 4, 3), (128, 8, 3), (256, 8, 3)]
                if noskip or ns == 2]
    if kind == "narrow":
        return [(f"{'D' if route else 'O'} m{bm} w{nw} s{ns}",
                 dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=ns, DENSE=route))
                for route in (True, False) for bm, nw, ns in TILES if route or C > 8]
    return [(f"{'D' if route else 'O'} m{bm} w{nw} n{n} k{k}",
             dict(BLOCK_M=bm, BLOCK_N=n, BLOCK_K=k, CHUNK=16, num_warps=nw, num_stages=2, DENSE=route))
            for route in (True, False) for bm, nw in ((64, 4), (128, 4), (256, 8))
            for n in sorted({16, min(32, bn), bn}) for k in sorted({16, bk})]


def sweep_layer(C, N, H, keep, gen, dev, kind="narrow"):
    w64, oi, off = random_layer(N, C, keep, gen)
    x = torch.randn(BATCH, C, H, H, generator=gen).to(dev, torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w, b = w64.to(torch.bfloat16), torch.randn(N, generator=gen).to(dev, torch.bfloat16)
    plan = kernels.stripe_plan(oi, off, N, 3)
    dense = stripe_to_dense(w, oi, off, N, 3, memory_format=torch.channels_last)
    ref = torch.relu(F.conv2d(x.double(), dense.double(), b.double(), 1, 1))
    cudnn_ms = _graph_ms(lambda: F.conv2d(x, dense, b, 1, 1), dev, 20)
    cudnn_relu_ms = _graph_ms(lambda: torch.cudnn_convolution_relu(x, dense, b, (1, 1), (1, 1), (1, 1), 1), dev, 20)
    default = stripe_triton.default_config(C, N, len(oi), 9, torch.bfloat16)
    cands = [("default", default)] + grid(C, N, kind)
    res = {}
    for name, cfg in cands:
        for kept in ((False, True) if cfg.get("DENSE") else (False,)):
            def fn(cfg=cfg, dn=dense if kept else None):
                return stripe_triton.forward(x, w, oi, off, b, plan, N, [3, 3], [1, 1], [1, 1], [1, 1], True,
                                             dict(cfg), dense=dn)
            key = name + (" cached" if kept else "")
            try:
                err = ((fn().double() - ref).norm() / ref.norm()).item()
                res[key] = {"ms": round(_graph_ms(fn, dev, 20), 5), "err": err}
            except Exception as e:  # a tiling over the device's resource limits
                res[key] = str(e)[:80]
    ok = {k: v for k, v in res.items() if isinstance(v, dict) and v["err"] < 1e-2}
    best = min(ok, key=lambda k: ok[k]["ms"])
    kept_ms = res.get("default cached")
    return dict(C=C, N=N, H=H, keep=keep, S=len(oi), cudnn_ms=round(cudnn_ms, 5), cudnn_relu_ms=round(cudnn_relu_ms, 5),
                default=default, default_ms=res["default"]["ms"],
                default_cached_ms=kept_ms["ms"] if isinstance(kept_ms, dict) else None,
                best=best, best_ms=ok[best]["ms"], all=res)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=("narrow", "vgg16", "noskip"), default="narrow")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows, t0 = [], time.time()
    shapes = {"narrow": SHAPES, "vgg16": VGG16_SHAPES, "noskip": NOSKIP_SHAPES}[args.set]
    for C, N, H, keep in shapes:
        r = sweep_layer(C, N, H, keep, gen, dev, kind=args.set)
        rows.append(r)
        print(f"C{C:3d} N{N:3d} H{H:2d} keep {keep:.2f} S{r['S']:4d} cudnn {r['cudnn_ms']:.4f} (bias+ReLU fused "
              f"{r['cudnn_relu_ms']:.4f}) default {r['default_ms']:.4f} kept {r['default_cached_ms']} "
              f"best {r['best']} {r['best_ms']:.4f}  [{time.time() - t0:.0f}s]", flush=True)
    gpu = torch.cuda.get_device_name()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"stripe_tiles_{args.set}_{gpu.split()[-1].lower()}.json")
    with open(out, "w") as f:
        json.dump(dict(gpu=gpu, batch=BATCH, dtype="bfloat16", layout="channels_last",
                       timing="CUDA graph of 10 calls, kernels.stripe._graph_ms, 20 repeats", rows=rows), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
