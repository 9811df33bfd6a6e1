"""Tile sweep of the stripe kernel on the compact models' low-resolution layers, where few output pixels make a
small grid (issue 5: the compact CIFAR VGG16's 8x8, 4x4 and 2x2 layers).

At batch 256 a 2x2 layer has 1024 output pixels: 64-128-pixel tiles give 8-16 row blocks, and with 64-128-channel
tiles the whole layer runs on a few dozen of the GPU's 132 SMs, each doing a long serial chain of small products.
cuDNN's dense conv has the same problem there (10-15 us for under 1 GMAC). This script takes every stripe layer of
the compact model (as `stripe_models_gpu.py` builds it: fold_bn, channel_multiple 8, bias + ReLU fused, bf16,
channels_last, its real input from one forward) with at most `--max-pixels` output pixels and times, in CUDA graphs
(GPU time, as `choose_modes` measures): cuDNN's fused conv + bias + ReLU on the zero-filled weight, the kernel's
default config and a grid of small tilings of route (a) (dense tiles, skipping offsets no channel of the tile
keeps: "D"; over every offset, pipelined: "N"), route (b) one-hot ("O") and gather ("G"); each output checked
against the float64 conv.

    python benchmarks/stripe_small_gpu.py [--models vgg16] [--variants real random] [--out results/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from _host import require_cuda  # noqa: E402
from stripe_models_gpu import MODELS, build_skeleton  # noqa: E402

import compress  # noqa: E402
import kernels  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402
from kernels import stripe_triton  # noqa: E402
from kernels._utils import conv_out_size  # noqa: E402
from kernels.stripe import _graph_ms  # noqa: E402


def grid(C: int, N: int) -> list[tuple[str, dict]]:
    """(name, config): small tiles of routes (a) "D", (b) one-hot "O" and (b) gather "G", and route (a) over every
    offset without the skip, software-pipelined ("N", NOSKIP)."""
    bk = stripe_triton._pow2(C, 16, 128)
    out = []
    for bm, bn in ((64, 32), (64, 64), (128, 64), (128, 128)):
        out.append((f"N m{bm} n{bn}", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16,
                                           num_warps=8 if bm * bn > 8192 else 4, num_stages=3, DENSE=True,
                                           NOSKIP=True)))
    for bm, bn in ((16, 16), (32, 16), (32, 32), (64, 16), (64, 32)):
        out.append((f"D m{bm} n{bn}", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=4, num_stages=2,
                                           DENSE=True)))
    for bm, bn in ((16, 32), (32, 32), (32, 64), (64, 32), (64, 64)):
        out.append((f"O m{bm} n{bn}", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=4, num_stages=2,
                                           DENSE=False)))
    for bm, bn, ch in ((32, 64, 16), (64, 64, 16), (32, 128, 32), (64, 128, 32)):
        out.append((f"G m{bm} n{bn} c{ch}", dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=ch, num_warps=4,
                                                 num_stages=2, DENSE=False, GATHER=True)))
    return out


def out_pixels(layer: StripeConv2d, x: torch.Tensor) -> int:
    """Output pixels (batch x height x width) of `layer` on `x`."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    return x.shape[0] * conv_out_size(x.shape[2], kh, sh, ph, dh) * conv_out_size(x.shape[3], kw, sw, pw, dw)


def layer_inputs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input of every stripe layer in one forward."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, StripeConv2d) and m.num_stripes:
            hooks.append(m.register_forward_hook(lambda mod, inp, out, name=name: seen.__setitem__(name, inp[0])))
    with torch.inference_mode():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def sweep(layer: StripeConv2d, x: torch.Tensor, dev: torch.device) -> dict:
    w, oi, off, plan = layer.weight.detach(), layer.out_index, layer.offset, layer.plan
    b = None if layer.bias is None else layer.bias.detach()
    N, ks, st, pd, dl = layer.out_channels, list(layer.kernel_size), list(layer.stride), list(layer.padding), \
        list(layer.dilation)
    dense = kernels.stripe_to_dense(w, oi, off, N, ks, memory_format=torch.channels_last)
    ref = torch.relu(F.conv2d(x.double(), dense.double(), b.double(), st, pd, dl))
    cudnn_ms = _graph_ms(lambda: torch.cudnn_convolution_relu(x, dense, b, st, pd, dl, 1), dev, 20)
    res = {}
    for name, cfg in [("default", None)] + grid(x.shape[1], N):
        try:
            launch = stripe_triton.prepare(x, w, oi, off, b, plan, N, ks, st, pd, dl, True, cfg, dense=dense)
            err = ((launch(x).double() - ref).norm() / ref.norm()).item()
            res[name] = {"ms": round(_graph_ms(lambda launch=launch: launch(x), dev, 20), 5), "err": err}
        except Exception as e:  # a tiling over the device's resource limits
            res[name] = str(e)[:80]
    ok = {k: v for k, v in res.items() if isinstance(v, dict)}
    bad = [k for k, v in ok.items() if not v["err"] < 1e-2]
    assert not bad, f"wrong results from {bad}"
    best = min(ok, key=lambda k: ok[k]["ms"])
    B, C, H, W = x.shape
    return dict(B=B, C=C, N=N, H=H, W=W, keep=round(len(oi) / (N * ks[0] * ks[1]), 3), S=len(oi),
                pixels=out_pixels(layer, x), cudnn_relu_ms=round(cudnn_ms, 5),
                default=stripe_triton.default_config(C, N, len(oi), ks[0] * ks[1], x.dtype, dense_given=True,
                                                     pixels=out_pixels(layer, x)),
                default_ms=ok["default"]["ms"], best=best, best_ms=ok[best]["ms"], all=res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["vgg16"], choices=list(MODELS))
    ap.add_argument("--variants", nargs="+", default=["real", "random"], choices=("real", "random"))
    ap.add_argument("--max-pixels", type=int, default=16384, help="layers with at most this many output pixels")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "stripe_small_gpu_h200.json"))
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    rows, t0 = [], time.time()
    for name in args.models:
        for variant in args.variants:
            built = build_skeleton(name, variant, 0, dict(MODELS[name]["kwargs"]))
            if built is None:
                continue
            model = compress.compact(built[0], fold_bn=True, channel_multiple=8, fuse_relu=True)
            model.to(device=dev, dtype=torch.bfloat16, memory_format=torch.channels_last)
            size = MODELS[name]["kwargs"]["input_size"]
            x = torch.randn(MODELS[name]["batch"], 3, size, size, device=dev, dtype=torch.bfloat16)
            inputs = layer_inputs(model, x.contiguous(memory_format=torch.channels_last))
            for lname, xin in inputs.items():
                layer = model.get_submodule(lname)
                if out_pixels(layer, xin) > args.max_pixels:
                    continue
                r = dict(model=name, variant=variant, layer=lname, **sweep(layer, xin, dev))
                rows.append(r)
                print(f"{name}/{variant} {lname:12s} {r['C']:3d}->{r['N']:3d} {r['H']}x{r['W']} keep {r['keep']:.2f}: "
                      f"cuDNN+ReLU {r['cudnn_relu_ms']:.4f}  default {r['default_ms']:.4f}  best {r['best']} "
                      f"{r['best_ms']:.4f}  [{time.time() - t0:.0f}s]", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16", layout="channels_last",
                timing="CUDA graph of 10 calls (kernels.stripe._graph_ms), median of 20")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
