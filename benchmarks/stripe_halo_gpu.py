"""The halo route of the stripe conv (kernels/stripe_halo.py) on a GPU: correctness against a float64 reference,
then GPU time per layer against the other ways StripeConv2d runs the same layer.

1. Correctness: random layers (3-64 input channels, 8-72 output channels, keep 0.1-0.6, 3x3/5x5/1x1 kernels,
   padding and dilation, bias or not, ReLU and 2x2 pool with floor and ceil mode, odd sizes), float16 and
   bfloat16, channels_last: max |halo - ref| / max |ref| with ref = F.conv2d in float64 on the same rounded
   inputs (masked dense weight), ReLU, max-pool.
2. Layers of compact models (compress.compact(fold_bn=True, channel_multiple=8, fuse_relu=True), bf16,
   channels_last, batch 256: CIFAR VGG16 and ResNet-56 with the real SWP masks and with random ones): each
   stride-1 StripeConv2d on its real input, timed in each mode it has (stripe = the Triton kernel, dense = cuDNN
   conv + bias + ReLU in one call, gemm where it fits) and through the halo kernel at the default tile and a few
   others; GPU time (kernels.stripe._graph_ms: CUDA graph of 10 calls, median of replays).
3. The per-layer shapes of benchmarks/stripe_gpu.py up to 64 channels with random masks (keep 0.3 and 0.15).

    python benchmarks/stripe_halo_gpu.py --out benchmarks/results/stripe_halo_h200.json
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
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from stripe_models_gpu import MODELS, build_skeleton  # noqa: E402

import compress  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402
from kernels import stripe_halo  # noqa: E402
from kernels._utils import conv_out_size  # noqa: E402
from kernels.stripe import _graph_ms  # noqa: E402

CL = torch.channels_last


def reference(x, layer: StripeConv2d) -> torch.Tensor:
    w = layer.dense_weight().double()
    b = None if layer.bias is None else layer.bias.double()
    y = F.conv2d(x.double(), w, b, layer.stride, layer.padding, layer.dilation)
    if layer.relu:
        y = y.relu()
    return F.max_pool2d(y, 2, ceil_mode=layer.pool_ceil) if layer.pool else y


def halo_call(layer: StripeConv2d, x: torch.Tensor, rows: int | None = None):
    """(fn, rows) running the layer on x through the halo kernel; fn None where no tile fits."""
    plan = stripe_halo.prepare(layer.weight.detach(), layer.out_index, layer.offset, layer.out_channels,
                               layer.kernel_size)
    hw = tuple(conv_out_size(n, k, 1, p, d) for n, k, p, d in
               zip(x.shape[2:], layer.kernel_size, layer.padding, layer.dilation))
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if rows is None:
        rows = stripe_halo.tile_rows(x.shape[0], hw, x.shape[1], layer.num_stripes, layer.out_channels,
                                     layer.kernel_size, layer.dilation, x.element_size(), layer.pool, sms)
    if rows is None:
        return None, None
    bias = None if layer.bias is None else layer.bias.detach()

    def fn():
        return stripe_halo.forward(x, plan, bias, layer.out_channels, layer.kernel_size, layer.padding,
                                   layer.dilation, layer.relu, layer.pool, layer.pool_ceil, rows)

    return fn, rows


def random_layer(C, N, k, pad, dil, keep, bias, relu, pool, ceil, dtype, gen) -> StripeConv2d:
    conv = torch.nn.Conv2d(C, N, k, padding=pad, dilation=dil, bias=bias)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) / (C * k * k * keep) ** 0.5)
        if bias:
            conv.bias.copy_(torch.randn(N, generator=gen) * 0.1)
    mask = torch.rand(N, k, k, generator=gen) < keep
    layer = StripeConv2d.from_dense(conv, mask)
    layer.relu, layer.pool, layer.pool_ceil = relu, pool, ceil
    return layer.to(device="cuda", dtype=dtype).eval()


@torch.no_grad()
def correctness(gen) -> list[dict]:
    cases = [  # C, N, k, pad, dil, keep, bias, relu, pool, ceil, B, H, W
        (40, 40, 3, 1, 1, 0.15, True, True, True, False, 4, 32, 32),
        (64, 72, 3, 1, 1, 0.3, True, True, False, False, 3, 16, 16),
        (16, 16, 3, 1, 1, 0.6, False, False, False, False, 2, 32, 32),
        (3, 40, 3, 1, 1, 0.2, True, True, False, False, 2, 32, 32),
        (20, 24, 3, 1, 1, 0.3, True, True, True, True, 2, 15, 13),
        (24, 8, 3, 1, 1, 0.3, True, False, True, False, 2, 9, 11),
        (32, 32, 5, 2, 1, 0.2, True, True, False, False, 2, 14, 14),
        (32, 48, 3, 2, 2, 0.3, False, True, False, False, 2, 12, 10),
        (48, 32, 1, 0, 1, 0.5, True, True, False, False, 2, 8, 8),
        (64, 64, 3, 0, 1, 0.1, True, False, False, False, 2, 10, 10),
    ]
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for C, N, k, pad, dil, keep, bias, relu, pool, ceil, B, H, W in cases:
            layer = random_layer(C, N, k, pad, dil, keep, bias, relu, pool, ceil, dtype, gen)
            x = torch.randn(B, C, H, W, generator=gen).to(device="cuda", dtype=dtype).contiguous(memory_format=CL)
            _, r = halo_call(layer, x)
            for rows_ in sorted({r or 2, 2}):
                fn, _ = halo_call(layer, x, rows_)
                y = fn()
                ref = reference(x, layer)
                err = float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                rows.append({"dtype": str(dtype).split(".")[-1], "C": C, "N": N, "k": k, "pad": pad, "dil": dil,
                             "keep": keep, "bias": bias, "relu": relu, "pool": pool, "ceil": ceil,
                             "x": [B, C, H, W], "rows": rows_, "layout_ok": y.is_contiguous(memory_format=CL),
                             "shape_ok": tuple(y.shape) == tuple(ref.shape), "rel_err": err})
                print(f"check {rows[-1]}", flush=True)
    return rows


def time_layer(layer: StripeConv2d, x: torch.Tensor, repeats: int, extra_rows=(1, 2, 4, 8)) -> dict:
    dev = x.device
    res = {"C": x.shape[1], "N": layer.out_channels, "x": list(x.shape), "S": layer.num_stripes,
           "keep": round(layer.num_stripes / (layer.out_channels * layer.kernel_size[0] * layer.kernel_size[1]), 3),
           "relu": layer.relu, "pool": layer.pool, "mode_ms": {}}
    old = layer.mode
    for mode in ("stripe", "dense", "gemm"):
        if mode == "gemm" and not layer._gemm_fits(x):
            continue
        layer.mode = mode
        res["mode_ms"][mode] = round(_graph_ms(lambda: layer(x), dev, repeats), 5)
    layer.mode = old
    fn, rows = halo_call(layer, x)
    if fn is None:
        res["halo_ms"] = None
        return res
    ref = reference(x, layer)
    res["halo_err"] = float((fn().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    res["halo_rows"] = rows
    res["halo_ms"] = round(_graph_ms(fn, dev, repeats), 5)
    res["halo_ms_by_rows"] = {}
    for r in extra_rows:
        if r == rows or (layer.pool and r % 2) or r > x.shape[2]:
            continue
        f2, _ = halo_call(layer, x, r)
        try:
            res["halo_ms_by_rows"][r] = round(_graph_ms(f2, dev, repeats), 5)
        except RuntimeError as e:  # shared memory
            res["halo_ms_by_rows"][r] = str(e).splitlines()[0][:80]
    best = min(res["mode_ms"].values())
    res["best_mode_ms"] = best
    res["halo_over_best"] = round(best / res["halo_ms"], 3)
    print(f"  {res}", flush=True)
    return res


def model_layers(name: str, variant: str, repeats: int) -> dict:
    kwargs = dict(MODELS[name]["kwargs"])
    skeleton, _ = build_skeleton(name, variant, 0, kwargs)
    small = compress.compact(skeleton, fold_bn=True, channel_multiple=8, fuse_relu=True)
    small = small.to(device="cuda", dtype=torch.bfloat16, memory_format=CL).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MODELS[name]["batch"], 3, 32, 32, generator=gen).to("cuda", torch.bfloat16)
    x = x.contiguous(memory_format=CL)
    inputs = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: inputs.__setitem__(n, a[0]))
             for n, m in small.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes]
    with torch.inference_mode():
        small(x)
    for h in hooks:
        h.remove()
    out = {}
    with torch.inference_mode():
        for n, xin in inputs.items():
            layer = small.get_submodule(n)
            if tuple(layer.stride) != (1, 1) or not xin.is_contiguous(memory_format=CL):
                continue
            print(f"{name}/{variant} {n}", flush=True)
            out[n] = time_layer(layer, xin, repeats)
    return out


def shape_rows(gen, repeats: int) -> list[dict]:
    rows = []
    for B, C, H in ((1024, 16, 32), (1024, 32, 16), (1024, 64, 8), (1024, 64, 32), (128, 64, 56)):
        for keep in (0.3, 0.15):
            layer = random_layer(C, C, 3, 1, 1, keep, True, True, False, False, torch.bfloat16, gen)
            x = torch.randn(B, C, H, H, generator=gen).to("cuda", torch.bfloat16).contiguous(memory_format=CL)
            print(f"shape B={B} C={C} H={H} keep={keep}", flush=True)
            with torch.inference_mode():
                rows.append(time_layer(layer, x, repeats))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": correctness(gen)}
    bad = [r for r in result["checks"] if r["rel_err"] > 1e-2 or not (r["layout_ok"] and r["shape_ok"])]
    print(f"correctness: {len(result['checks'])} checks, {len(bad)} failures", flush=True)
    result["models"] = {}

    def save():
        result["seconds"] = round(time.time() - t0, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    for m in ("vgg16", "resnet56"):
        for v in ("real", "random"):
            result["models"][f"{m}/{v}"] = model_layers(m, v, args.repeats)
            save()
    result["shapes"] = shape_rows(gen, args.repeats)
    save()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
