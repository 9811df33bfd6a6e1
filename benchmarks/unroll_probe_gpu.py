"""The compact VGG16's small-map layers as one GEMM with an unrolled weight (``kernels.unrolled``, StripeConv2d's
"gemm" mode) against the layer's dense mode (cuDNN conv + bias + ReLU, then the pool where the layer pools).

Every stripe layer of the compact model (as ``stripe_models_gpu.py`` builds it: fold_bn, channel_multiple 8, bias +
ReLU and pools fused, bf16, channels_last, batch 256, its real input from one forward) whose input is at most 8x8.
GPU time per call in CUDA graphs (``kernels.stripe._graph_ms``, as ``choose_modes`` measures); each gemm output
checked against the dense mode's (relative error).

    python benchmarks/unroll_probe_gpu.py [--variant real|random] [--out benchmarks/results/unroll_probe_h200.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from _host import require_cuda  # noqa: E402
from stripe_models_gpu import CIFAR, build_skeleton  # noqa: E402

import compress  # noqa: E402
from compress.stripe import StripeConv2d  # noqa: E402
from kernels import unrolled  # noqa: E402
from kernels.stripe import _graph_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", choices=("real", "random"), default="real")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "unroll_probe_h200.json"))
    args = ap.parse_args()
    require_cuda(__file__)
    torch.backends.cudnn.benchmark = True
    dev, dt, fmt = torch.device("cuda"), torch.bfloat16, torch.channels_last
    skeleton, _ = build_skeleton("vgg16", args.variant, 0, CIFAR)
    small = compress.compact(skeleton, fold_bn=True, channel_multiple=8, fuse_relu=True).eval()
    small.to(device=dev, dtype=dt, memory_format=fmt)
    layers = {n: m for n, m in small.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes}
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0].clone())) for n, m in layers.items()]
    x = torch.randn(256, 3, 32, 32, device=dev, dtype=dt).contiguous(memory_format=fmt)
    with torch.inference_mode():
        small(x)
        for h in hooks:
            h.remove()
        rows = []
        for name, m in layers.items():
            xi = inputs[name]
            B, C, H, W = xi.shape
            if H * W > 64:
                continue
            m.mode = "dense"
            ref = m(xi).float()
            dense_ms = _graph_ms(partial(m, xi), dev, 15)
            u, b, out_hw = m._cached_unrolled(xi)
            m.mode = "gemm"
            y = m(xi).float()
            row = dict(layer=name, C=C, N=m.out_channels, H=H, W=W, pool=m.pool, dense_ms=round(dense_ms, 4),
                       gemm_ms=round(_graph_ms(partial(m, xi), dev, 15), 4),
                       gemm_only_ms=round(_graph_ms(partial(unrolled.unrolled_conv2d, xi, u, b, out_hw, m.relu), dev, 15), 4),
                       fits=unrolled.fits(C, m.out_channels, (H, W), m.kernel_size, m.stride, m.padding, m.dilation, 2),
                       rel_err=((y - ref).norm() / ref.norm()).item(), unrolled_mib=round(u.numel() * 2 / 2**20, 2))
            if m.pool and out_hw[0] % 2 == 0 and out_hw[1] % 2 == 0:  # the pool as one reduction over a view
                def gemm_amax(xi=xi, u=u, b=b, out_hw=out_hw, m=m):
                    y = unrolled.unrolled_conv2d(xi, u, b, out_hw, m.relu).permute(0, 2, 3, 1)
                    ho, wo = out_hw
                    return y.reshape(y.shape[0], ho // 2, 2, wo // 2, 2, -1).amax((2, 4)).permute(0, 3, 1, 2)

                y2 = gemm_amax().float()
                row["gemm_amax_pool_ms"] = round(_graph_ms(gemm_amax, dev, 15), 4)
                row["gemm_amax_pool_rel_err"] = ((y2 - ref).norm() / ref.norm()).item()
            print(row, flush=True)
            rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "variant": args.variant, "batch": 256,
            "dtype": "bf16", "layout": "channels_last"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
