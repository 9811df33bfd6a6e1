"""GPU backward of ``compress::stripe_conv2d`` per layer: the Triton pieces against cuDNN's (issue 5).

For each layer shape (3x3, stride 1, padding 1, random stripe masks) and dtype (bf16 and fp32, channels_last):
- correctness: the Triton grad_x and grad_weight on 8 images against float64 ``convolution_backward`` of the
  zero-filled dense weight (kept stripes of grad_weight);
- times (CUDA graphs, no launch overhead): cuDNN's dgrad and wgrad with the zero-filled weight (what the op ran
  before), the Triton grad_x (``stripe_triton._grad_input``: the forward kernel on the output gradient with the
  flipped weight; given the zero-filled weight, as the op gives it) and grad_weight (``_grad_weight``: dense
  products on tensor cores, a slice sum, the kept stripes),
  and the op's whole backward with ``COMPRESS_STRIPE_BWD`` = auto (the default rule), triton and cudnn.

    python benchmarks/stripe_bwd_gpu.py --out benchmarks/results/stripe_bwd_gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _host import require_cuda  # noqa: E402

import kernels
from kernels import stripe_triton
from kernels.stripe import _graph_ms

SHAPES = [  # (name, B, C = N, H)
    ("resnet56", 256, 16, 32), ("resnet56", 256, 32, 16), ("resnet56", 256, 64, 8),
    ("compact", 256, 8, 32), ("compact", 256, 24, 32), ("compact", 256, 40, 32), ("compact", 256, 48, 16),
    ("cifar", 1024, 16, 32), ("cifar", 1024, 32, 16), ("cifar", 1024, 64, 8),
    ("vgg", 256, 64, 32), ("vgg", 256, 128, 16),
    ("imagenet", 128, 64, 56), ("imagenet", 128, 128, 28),
]


def layer(C, N, keep, gen):
    """Random stripes (canonical order) of a 3x3 layer: weight (S, C) float64, out_index, offset (CUDA)."""
    m = torch.rand(N, 3, 3, generator=gen) < keep
    m[0, 1, 1] = True
    k, o = torch.nonzero(m.permute(1, 2, 0).reshape(9, N), as_tuple=True)  # offset-major: canonical order
    w = torch.randn(len(o), C, generator=gen, dtype=torch.float64) / (3 * C**0.5)
    off = torch.stack([k // 3, k % 3], 1)
    return w.cuda(), o.cuda(), off.cuda()


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


CONV = [[1, 1], [1, 1], [1, 1], False, [0, 0], 1]  # stride, padding, dilation, transposed, output padding, groups


def time_case(g, x, w, wd, oi, off, plan, N, ok_x, ok_w, dev, repeats) -> dict:
    """ms per call (CUDA graphs) of cuDNN's dgrad and wgrad, the supported Triton pieces and the op's backward
    under each COMPRESS_STRIPE_BWD choice."""
    ks, one = [3, 3], [1, 1]
    t = {
        "cudnn_dgrad_ms": _graph_ms(lambda: torch.ops.aten.convolution_backward(
            g, x, wd, None, *CONV, [True, False, False]), dev, repeats),
        "cudnn_wgrad_ms": _graph_ms(lambda: torch.ops.aten.convolution_backward(
            g, x, wd, None, *CONV, [False, True, False]), dev, repeats),
    }
    if ok_x:
        t["triton_dx_ms"] = _graph_ms(lambda: stripe_triton.backward(g, x, w, oi, off, N, ks, one, one, one, True,
                                                                     False, dense_w=wd), dev, repeats)
    if ok_w:
        t["triton_dw_ms"] = _graph_ms(lambda: stripe_triton.backward(g, x, w, oi, off, N, ks, one, one, one, False,
                                                                     True), dev, repeats)
    for choice in ("auto", "triton", "cudnn"):
        os.environ["COMPRESS_STRIPE_BWD"] = choice  # read when the graph is captured
        t[f"op_bwd_{choice}_ms"] = _graph_ms(lambda: torch.ops.compress.stripe_conv2d_backward(
            g, x, w, oi, off, plan, N, ks, one, one, one, True, True), dev, repeats)
    os.environ.pop("COMPRESS_STRIPE_BWD")
    return {k: round(v, 4) for k, v in t.items()}


def fmt(t: dict, key: str) -> str:
    return f"{t[key]:.4f}" if key in t else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_cuda(__file__)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'shape':22s} {'dtype':5s} {'cudnn dgrad':>11s} {'triton dx':>9s} {'cudnn wgrad':>11s} {'triton dw':>9s} | "
          f"{'op bwd auto':>11s} {'triton':>7s} {'cudnn':>7s}  err dx/dw")
    for name, B, C, H in SHAPES:
        N = C
        w64, oi, off = layer(C, N, args.keep, gen)
        plan = kernels.stripe_plan(oi, off, N, 3)
        x64 = torch.randn(B, C, H, H, generator=gen, dtype=torch.float64).cuda()
        g64 = torch.randn(B, N, H, H, generator=gen, dtype=torch.float64).cuda()
        wd64 = kernels.stripe_to_dense(w64, oi, off, N, 3)
        want_x, want_w, _ = torch.ops.aten.convolution_backward(g64[:8], x64[:8], wd64, None, *CONV,
                                                                [True, True, False])
        want_w = want_w[oi, :, off[:, 0], off[:, 1]]
        for dname, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            cl = torch.channels_last
            x, g = x64.to(dt).contiguous(memory_format=cl), g64.to(dt).contiguous(memory_format=cl)
            w, wd = w64.to(dt), wd64.to(dt).contiguous(memory_format=cl)
            ok_x, ok_w = stripe_triton.backward_support(x, N, (3, 3), (1, 1), (1, 1), (1, 1))
            tdx, tdw = stripe_triton.backward(g[:8], x[:8], w, oi, off, N, [3, 3], [1, 1], [1, 1], [1, 1], ok_x, ok_w)
            err = (rel(tdx, want_x) if ok_x else None, rel(tdw, want_w) if ok_w else None)
            t = time_case(g, x, w, wd, oi, off, plan, N, ok_x, ok_w, dev, args.repeats)
            row = dict(net=name, B=B, C=C, N=N, H=H, keep=args.keep, stripes=len(oi), dtype=dname, layout="cl",
                       err_dx=err[0], err_dw=err[1], **t)
            rows.append(row)

            print(f"{name:9s} {B:4d}x{C:3d}x{H:3d}   {dname:5s} {fmt(t, 'cudnn_dgrad_ms'):>11s} "
                  f"{fmt(t, 'triton_dx_ms'):>9s} {fmt(t, 'cudnn_wgrad_ms'):>11s} {fmt(t, 'triton_dw_ms'):>9s} | "
                  f"{fmt(t, 'op_bwd_auto_ms'):>11s} {fmt(t, 'op_bwd_triton_ms'):>7s} {fmt(t, 'op_bwd_cudnn_ms'):>7s}  "
                  + "/".join("-" if e is None else f"{e:.1e}" for e in err), flush=True)
    report = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "keep": args.keep,
                       "timing": "kernels.stripe._graph_ms: median of CUDA-graph replays of 10 calls, per call",
                       "masks": "random, offset-major canonical order, stride 1, padding 1"},
              "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.out}")
    tol = {"bf16": 1e-2, "fp32": 1e-3}  # relative error against float64 (fp32 runs in TF32)
    wrong = [f"{r['net']} {r['C']}x{r['H']} {r['dtype']}" for r in rows
             if any(e is not None and not e <= tol[r["dtype"]] for e in (r["err_dx"], r["err_dw"]))]
    if wrong:
        raise SystemExit(f"stripe_bwd_gpu.py: gradients beyond tolerance in {wrong}; their timings do not count")


if __name__ == "__main__":
    main()
