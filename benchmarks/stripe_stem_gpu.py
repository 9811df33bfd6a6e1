"""First-layer (RGB input) stripe convs on the GPU: cuDNN's dense conv against the stripe kernel's routes (issue 5).

With 3 input channels the per-offset routes waste most of a tensor-core step; route (c), IM2COL, multiplies the
dense weight with im2col rows instead (kernels/stripe_triton.py). Layers: the ImageNet stem (7x7, stride 2,
3 -> 64 and 3 -> 24 channels, batch 128, 224x224) and the CIFAR VGG16 first conv (3x3, 3 -> 40 and 3 -> 64,
batch 256, 32x32); random stripe masks at the keep given; bf16, channels_last, bias + ReLU fused on both sides
(torch.cudnn_convolution_relu). Times: triton.testing.do_bench medians (CUDA events, L2 flushed). Each config's
output is checked against the float64 dense conv (relative error). Configs: the route (a) config the kernel used
before route (c), a sweep of route (c) tilings and the default.

    python benchmarks/stripe_stem_gpu.py            # -> benchmarks/results/stripe_stem_gpu_h200.json
    python benchmarks/stripe_stem_gpu.py --narrow   # 16-64 channels -> stripe_narrow_im2col_gpu_h200.json
    python benchmarks/stripe_stem_gpu.py --narrow --dtype fp32   # -> stripe_narrow_im2col_fp32_gpu_h200.json (TF32)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from _host import require_cuda  # noqa: E402
from test_kernels_stripe import random_layer  # noqa: E402

import kernels  # noqa: E402
from kernels import stripe_triton  # noqa: E402

# (name, batch, C, H, N, kernel, stride, padding, keep)
LAYERS = [("imagenet_stem", 128, 3, 224, 64, 7, 2, 3, 0.053), ("imagenet_stem", 128, 3, 224, 64, 7, 2, 3, 0.33),
          ("imagenet_stem_24", 128, 3, 224, 24, 7, 2, 3, 0.32), ("vgg_first", 256, 3, 32, 40, 3, 1, 1, 0.12),
          ("vgg_first", 256, 3, 32, 64, 3, 1, 1, 0.5)]  # fmt: skip
ROUTE_A = dict(BLOCK_M=128, BLOCK_N=16, BLOCK_K=16, CHUNK=16, num_warps=4, num_stages=2, DENSE=True)
# --narrow: layers of 16-64 input channels, where the default is route (a) with the dense weight kept: does the
# im2col route pad less and win there too?
NARROW = [("vgg_40", 256, 40, 32, 40, 3, 1, 1, 0.14), ("vgg_64", 256, 64, 32, 64, 3, 1, 1, 0.3),
          ("resnet56_16", 256, 16, 32, 16, 3, 1, 1, 0.5), ("resnet56_32", 256, 32, 16, 32, 3, 1, 1, 0.5),
          ("resnet56_64", 256, 64, 8, 64, 3, 1, 1, 0.5), ("imagenet_64", 128, 64, 56, 64, 3, 1, 1, 0.3)]  # fmt: skip


def candidates(N: int, columns: int, narrow: bool) -> list[tuple[str, dict | None]]:
    bn = stripe_triton._pow2(N, 16, 64)
    if narrow:
        out = [(f"route_a_m128_k{bk}_w4_s3", dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=4,
                                                   num_stages=3, DENSE=True, NOSKIP=True)) for bk in (16, 32)]
    else:
        out = [("route_a_before", ROUTE_A)]
    for bm, bk, (nw, ns) in itertools.product((64, 128, 256), (32, 64), ((4, 2), (4, 3), (8, 3))):
        if (bm == 256 and nw == 4) or (bm == 64 and nw == 8) or (bk == 64 and columns <= 32):
            continue
        out.append((f"im2col_m{bm}_n{bn}_k{bk}_w{nw}_s{ns}",
                    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNK=16, num_warps=nw, num_stages=ns, IM2COL=True)))
    return out + [("default", None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--narrow", action="store_true", help="16-64-channel layers instead of first layers")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="fp32: TF32 tensor cores on both sides")
    args = ap.parse_args()
    require_cuda(__file__)
    kind = ("narrow_im2col" if args.narrow else "stem") + ("_fp32" if args.dtype == "fp32" else "")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"stripe_{kind}_gpu_h200.json")
    from triton.testing import do_bench

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    dt, tol = (torch.bfloat16, 1e-2) if args.dtype == "bf16" else (torch.float32, 1e-3)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, B, C, H, N, k, s, p, keep in NARROW if args.narrow else LAYERS:
        w, oi, off = random_layer(N, C, (k, k), keep, gen, dtype=torch.float32)
        w, oi, off = w.cuda().to(dt), oi.cuda(), off.cuda()
        x = torch.randn(B, C, H, H, device="cuda", dtype=dt).contiguous(memory_format=torch.channels_last)
        b = torch.randn(N, device="cuda", dtype=dt)
        plan = kernels.stripe_plan(oi, off, N, (k, k))
        dense = kernels.stripe_to_dense(w, oi, off, N, (k, k), memory_format=torch.channels_last)
        ref = F.relu(F.conv2d(x.double(), dense.double(), b.double(), s, p))

        def bench(fn):
            return do_bench(fn, warmup=25, rep=200, return_mode="median")

        cudnn = partial(torch.cudnn_convolution_relu, x, dense, b, (s, s), (p, p), (1, 1), 1)
        row = dict(layer=name, B=B, C=C, H=H, N=N, kernel=k, stride=s, keep=keep, dtype=args.dtype,
                   layout="channels_last", cudnn_ms=round(bench(cudnn), 4), configs=[])  # fmt: skip
        for label, cfg in candidates(N, k * k * C, args.narrow):
            launch = stripe_triton.prepare(x, w, oi, off, b, plan, N, [k, k], [s, s], [p, p], [1, 1], True,
                                           config=cfg, dense=dense)  # fmt: skip
            try:
                y = launch(x)
            except Exception as e:  # a tiling over the shared-memory limit (fp32 tiles are twice the bytes)
                print(f"   skip {label}: {type(e).__name__}", flush=True)
                continue
            err = ((y.double() - ref).norm() / ref.norm()).item()
            row["configs"].append(dict(label=label, ms=round(bench(partial(launch, x)), 4), rel_err=err))
        best = min(row["configs"], key=lambda c: c["ms"])
        dflt = row["configs"][-1]
        row.update(best=best["label"], default_speedup_vs_cudnn=round(row["cudnn_ms"] / dflt["ms"], 2))
        print(f"{name} B{B} {C}->{N} k{k} s{s} keep {keep}: cuDNN {row['cudnn_ms']:.4f} ms | "
              f"{row['configs'][0]['label']} {row['configs'][0]['ms']:.4f} | default {dflt['ms']:.4f} ({row['default_speedup_vs_cudnn']}x cuDNN, "
              f"err {dflt['rel_err']:.1e}) | best {best['label']} {best['ms']:.4f}", flush=True)
        assert all(c["rel_err"] < tol for c in row["configs"]), "a config computed a wrong result"
        rows.append(row)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
