"""GPU check + benchmark of the compress:: ops (pix, depthwise_conv2d, conv2d) against PyTorch/cuDNN.

1. Correctness: every op against a float64 reference written from the definition (F.conv2d in float64 for the
   convs) on random inputs, forward and gradients, float32 (rel. error < 1e-5) and bfloat16 (< 1e-2), NCHW and
   channels_last.
2. Timing: median of CUDA-event timings of CUDA-graph replays (each graph holds >= 20 calls cycling through
   enough input sets to exceed 4x the L2 cache), after warm-up, 30 repeats. Baselines (PiX written with PyTorch
   ops; F.conv2d / cuDNN with cudnn.benchmark off and on, the better one) get the same treatment. The memory
   floor of the memory-bound ops is bytes moved / the device-to-device copy bandwidth measured in this run.

    python benchmarks/kernels_gpu.py --out benchmarks/results/kernels_h200.json
"""

# ruff: noqa: B023  (the lambdas are timed inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from _host import require_cuda  # noqa: E402

import kernels  # noqa: E402
from kernels import _ext  # noqa: E402

DEV = "cuda"
L2 = 60 * 2**20
RESULTS: dict = {"correctness": [], "copy": {}, "pix": [], "depthwise": [], "conv2d": []}


# ------------------------------------------------------------------------------------------------ timing
def bench_eager(fns, min_calls=20, reps=30) -> float:
    """Median milliseconds per call of eager launches (CPU dispatch overhead included when it dominates)."""
    for _ in range(2):
        for f in fns:
            f()
    torch.cuda.synchronize()
    n = max(min_calls, len(fns))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        for i in range(n):
            fns[i % len(fns)]()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / n)
    return statistics.median(ts)


def bench(fns, min_calls=20, reps=30, graph=True) -> float:
    """Median milliseconds per call over CUDA-graph replays; fns are callables, one per input set."""
    if not graph:
        return bench_eager(fns, min_calls, reps)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    n = max(min_calls, len(fns))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / n)
    del g
    return statistics.median(ts)


class env:
    """Set environment variables for a block (the kernels' A/B switches are read at each call)."""

    def __init__(self, **kv):
        self.kv, self.old = kv, {}

    def __enter__(self):
        for k, v in self.kv.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *a):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def nsets(bytes_per_set: int) -> int:
    return max(1, min(16, math.ceil(4 * L2 / max(1, bytes_per_set))))


def copy_bandwidth() -> float:
    n = 2**28  # 1 GiB of fp32
    a = torch.empty(n, device=DEV)
    b = torch.empty(n, device=DEV)
    ms_memcpy = bench([lambda: b.copy_(a)], min_calls=5, graph=False)
    ms_kernel = bench([lambda: torch.mul(a, 1.0, out=b)], min_calls=5)  # an SM copy kernel, in a graph
    ms = min(ms_memcpy, ms_kernel)
    bw = 2 * n * 4 / (ms * 1e-3)
    RESULTS["copy"] = {"bytes": 2 * n * 4, "memcpy_ms": ms_memcpy, "kernel_copy_ms": ms_kernel,
                       "memcpy_TBps": 2 * n * 4 / (ms_memcpy * 1e-3) / 1e12,
                       "kernel_copy_TBps": 2 * n * 4 / (ms_kernel * 1e-3) / 1e12, "TBps": bw / 1e12}
    return bw


def same_size_copy(nbytes: int) -> float:
    """Milliseconds of an in-graph copy kernel that reads and writes nbytes in all (nbytes / 2 each way), inputs
    rotated like the ops': the floor a kernel moving that many bytes can reach at this size (launch and ramp
    included), beside the bandwidth floor of a 1 GiB copy."""
    n = max(1, nbytes // 8)  # float32 elements per direction
    k = nsets(nbytes)
    src = [torch.empty(n, device=DEV) for _ in range(k)]
    dst = [torch.empty(n, device=DEV) for _ in range(k)]
    return bench([lambda i=i: torch.mul(src[i], 1.0, out=dst[i]) for i in range(k)])


# ------------------------------------------------------------------------------------------- references
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pix_ref64(x, p, zeta, tau):
    """float64 PiX from the definition; backward via first arg-max (argmax returns the first maximum)."""
    x, p = x.double(), p.double()
    B, C, H, W = x.shape
    xg = x.reshape(B, C // zeta, zeta, H, W)
    mx, arg = xg.max(2)
    use_max = p.float() < tau
    y = p * torch.where(use_max, mx, xg.mean(2))
    return y, arg, use_max


def pix_grads64(dy, x, p, zeta, tau):
    x, p, dy = x.double(), p.double(), dy.double()
    B, C, H, W = x.shape
    y, arg, use_max = pix_ref64(x, p, zeta, tau)
    xg = x.reshape(B, C // zeta, zeta, H, W)
    onehot = F.one_hot(arg, zeta).permute(0, 1, 4, 2, 3).double()
    pg = (p * dy).unsqueeze(2)
    dx = torch.where(use_max.unsqueeze(2), onehot * pg, pg.expand_as(xg) / zeta).reshape(B, C, H, W)
    sel = torch.where(use_max, xg.max(2).values, xg.mean(2))
    dp = (sel * dy).sum((2, 3), keepdim=True)
    return dx, dp


def record(op, dtype, layout, what, err, tol):
    ok = err < tol
    RESULTS["correctness"].append({"op": op, "dtype": str(dtype).replace("torch.", ""), "layout": layout,
                                   "what": what, "rel_err": err, "tol": tol, "ok": ok})
    print(f"  {op:18s} {str(dtype):15s} {layout:14s} {what:10s} rel_err={err:.2e} (< {tol:g}) {'ok' if ok else 'FAIL'}")


def check_conv(op, fn, conv_args, tensors64, dtype, layout, fmt, tol, label, g):
    """Record fwd, dx, dw, db errors of `fn(x, w, b)` on DEV in `dtype`/`fmt` against F.conv2d(*tensors64,
    *conv_args) (stride, padding, dilation, groups) in float64 on the CPU."""
    ts = [t.to(DEV, dtype) for t in tensors64]
    ts[0] = ts[0].contiguous(memory_format=fmt)
    ts = [t.requires_grad_(True) for t in ts]
    y = fn(*ts)
    r = [t.detach().cpu().double().requires_grad_(True) for t in ts]
    yr = F.conv2d(*r, *conv_args)
    record(op, dtype, layout, f"fwd {label}", rel(y.cpu(), yr), tol)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    gs = torch.autograd.grad(y, ts, dy.to(DEV, dtype))
    grs = torch.autograd.grad(yr, r, dy)
    for nm, a, bb in zip(("dx", "dw", "db"), gs, grs):
        record(op, dtype, layout, f"{nm} {label}", rel(a.cpu(), bb), tol)


def correctness():
    print("== correctness against float64 references")
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
        for layout in ("nchw", "channels_last"):
            fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
            # PiX, with ties in half the batch
            for shape, zeta in (((8, 64, 14, 14), 4), ((4, 48, 7, 7), 3), ((4, 32, 8, 9), 2)):
                x = torch.randn(shape, generator=g, dtype=torch.float64)
                x[: shape[0] // 2] = x[: shape[0] // 2].round()
                p = torch.rand(shape[0], shape[1] // zeta, 1, 1, generator=g, dtype=torch.float64)
                xd = x.to(DEV, dtype).contiguous(memory_format=fmt).requires_grad_(True)
                pd = p.to(DEV, dtype).requires_grad_(True)
                y = kernels.pix(xd, pd, zeta)
                yr, _, _ = pix_ref64(xd.detach().cpu(), pd.detach().cpu(), zeta, 0.5)
                record("pix", dtype, layout, f"fwd z{zeta}", rel(y.cpu(), yr), tol)
                dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(DEV, dtype)
                dx, dp = torch.autograd.grad(y, (xd, pd), dy)
                dxr, dpr = pix_grads64(dy.cpu(), xd.detach().cpu(), pd.detach().cpu(), zeta, 0.5)
                record("pix", dtype, layout, f"dx z{zeta}", rel(dx.cpu(), dxr), tol)
                record("pix", dtype, layout, f"dp z{zeta}", rel(dp.cpu(), dpr), tol)
            # depthwise and im2col conv against F.conv2d in float64
            for C, H, k, s, pad, d in ((32, 28, 3, 1, 1, 1), (24, 15, 5, 2, 2, 1), (16, 12, 3, 1, 2, 2), (8, 9, 7, 1, 3, 1),
                                     (40, 16, 3, 2, 1, 1), (24, 24, 7, 2, 3, 1)):
                x = torch.randn(4, C, H, H, generator=g, dtype=torch.float64)
                w = torch.randn(C, 1, k, k, generator=g, dtype=torch.float64)
                b = torch.randn(C, generator=g, dtype=torch.float64)
                check_conv("depthwise_conv2d", lambda *t, s=s, pad=pad, d=d: kernels.depthwise_conv2d(*t, s, pad, d),
                           (s, pad, d, C), (x, w, b), dtype, layout, fmt, tol, f"k{k}s{s}", g)
            if dtype == torch.float16:
                continue
            for C, Co, H, k, s, pad, d, grp in ((16, 32, 14, 3, 1, 1, 1, 1), (16, 24, 11, 3, 2, 1, 2, 4)):
                x = torch.randn(4, C, H, H, generator=g, dtype=torch.float64)
                w = torch.randn(Co, C // grp, k, k, generator=g, dtype=torch.float64)
                b = torch.randn(Co, generator=g, dtype=torch.float64)
                check_conv("conv2d", lambda *t, s=s, pad=pad, d=d, grp=grp: kernels.conv2d(*t, s, pad, d, grp),
                           (s, pad, d, grp), (x, w, b), dtype, layout, fmt, tol, f"g{grp}", g)


# ------------------------------------------------------------------------------------------------- PiX
# The issue's own floor, from its example: a 0.086 ms floor for the 64x256x56x56 float32 forward, whose input +
# output are 64*256*56*56*4 * 1.25 bytes: an effective 2.99 TB/s, applied here to every row's bytes beside the
# stricter floor at the bandwidth this run measures (a 1 GiB copy, about 4.2 TB/s on an H200).
ISSUE_FLOOR_BPS = 64 * 256 * 56 * 56 * 4 * 1.25 / 0.086e-3


def bench_pix(bw, sizes=(56, 28, 14, 7)):
    print("== PiX (B=64, zeta=4), ms; floor = bytes / measured copy bandwidth")
    print(f"  {'shape':18s} {'dtype':9s} {'layout':6s} {'fwd':>7s} {'floor':>7s} {'x':>5s} {'torch':>7s} {'spd':>5s} | "
          f"{'bwd':>7s} {'floor':>7s} {'x':>5s} {'torch':>7s} {'spd':>5s}")
    ops = torch.ops.compress
    for C, H in ((256, 56), (512, 28), (1024, 14), (2048, 7)):
        if H not in sizes:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            for layout in ("nchw", "cl"):
                fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
                B, z = 64, 4
                es = torch.tensor([], dtype=dtype).element_size()
                xbytes = B * C * H * H * es
                ybytes = xbytes // z
                k = nsets(xbytes + ybytes)
                xs = [torch.randn(B, C, H, H, device=DEV, dtype=dtype).contiguous(memory_format=fmt) for _ in range(k)]
                ps = [torch.rand(B, C // z, 1, 1, device=DEV, dtype=dtype) for _ in range(k)]
                dys = [torch.randn(B, C // z, H, H, device=DEV, dtype=dtype).contiguous(memory_format=fmt) for _ in range(k)]
                fwd = bench([lambda i=i: ops.pix(xs[i], ps[i], z, 0.5) for i in range(k)])
                fwd_eager = bench([lambda i=i: kernels.pix(xs[i], ps[i], z, 0.5) for i in range(k)], graph=False)
                bwd = bench([lambda i=i: ops.pix_backward(dys[i], xs[i], ps[i], z, 0.5) for i in range(k)])
                t_fwd = bench([lambda i=i: kernels.pix_reference(xs[i], ps[i], z, 0.5) for i in range(k)])
                xr = [x.clone().requires_grad_(True) for x in xs[:2]]
                pr = [p.clone().requires_grad_(True) for p in ps[:2]]
                t_fb = bench([lambda i=i: torch.autograd.grad(kernels.pix_reference(xr[i], pr[i], z, 0.5), (xr[i], pr[i]), dys[i])
                              for i in range(len(xr))])
                # the forward on the same 2 input sets (as warm in L2 as the forward + backward's) for the difference
                t_fwd_same = bench([lambda i=i: kernels.pix_reference(xs[i], ps[i], z, 0.5) for i in range(len(xr))])
                t_bwd = max(t_fb - t_fwd_same, 1e-6)
                f_fwd = (xbytes + ybytes) / bw * 1e3
                f_bwd = (2 * xbytes + ybytes) / bw * 1e3
                fi_fwd, fi_bwd = (xbytes + ybytes) / ISSUE_FLOOR_BPS * 1e3, (2 * xbytes + ybytes) / ISSUE_FLOOR_BPS * 1e3
                copy_fwd, copy_bwd = same_size_copy(xbytes + ybytes), same_size_copy(2 * xbytes + ybytes)
                ab = {}
                if layout == "nchw" and H <= 28:  # small planes: block-wide steps per thread of the NCHW kernels
                    for st in ("1", "4"):
                        with env(COMPRESS_PIX_STEPS=st):
                            ab[f"fwd_ms_steps{st}"] = bench([lambda i=i: ops.pix(xs[i], ps[i], z, 0.5) for i in range(k)])
                            ab[f"bwd_ms_steps{st}"] = bench([lambda i=i: ops.pix_backward(dys[i], xs[i], ps[i], z, 0.5)
                                                             for i in range(k)])
                if layout == "nchw" and H % 2 == 1:  # odd planes: the warp-staged kernels (16-bit) off
                    with env(COMPRESS_PIX_STAGE="0"):
                        ab["fwd_ms_stage_off"] = bench([lambda i=i: ops.pix(xs[i], ps[i], z, 0.5) for i in range(k)])
                        ab["bwd_ms_stage_off"] = bench([lambda i=i: ops.pix_backward(dys[i], xs[i], ps[i], z, 0.5)
                                                        for i in range(k)])
                if layout == "cl" and H * H <= 64:  # small planes: dp written by the backward kernel itself, off
                    with env(COMPRESS_PIX_CL_DIRECT="0"):
                        ab["bwd_ms_direct_off"] = bench([lambda i=i: ops.pix_backward(dys[i], xs[i], ps[i], z, 0.5)
                                                         for i in range(k)])
                if layout == "cl":
                    with env(COMPRESS_PIX_CL_GPT="1"):
                        ab["bwd_ms_gpt1"] = bench([lambda i=i: ops.pix_backward(dys[i], xs[i], ps[i], z, 0.5)
                                                   for i in range(k)])
                row = {"B": B, "C": C, "H": H, "W": H, "zeta": z, "dtype": str(dtype).replace("torch.", ""),
                       "layout": layout, "fwd_ms": fwd, "fwd_eager_ms": fwd_eager, "bwd_ms": bwd, "floor_fwd_ms": f_fwd, "floor_bwd_ms": f_bwd,
                       "torch_fwd_ms": t_fwd, "torch_fwd_bwd_ms": t_fb, "torch_bwd_ms": t_bwd,
                       "fwd_over_floor": fwd / f_fwd, "bwd_over_floor": bwd / f_bwd,
                       "issue_floor_fwd_ms": fi_fwd, "issue_floor_bwd_ms": fi_bwd,
                       "fwd_over_issue_floor": fwd / fi_fwd, "bwd_over_issue_floor": bwd / fi_bwd,
                       "copy_fwd_ms": copy_fwd, "copy_bwd_ms": copy_bwd,
                       "fwd_over_copy": fwd / copy_fwd, "bwd_over_copy": bwd / copy_bwd,
                       "fwd_speedup": t_fwd / fwd, "bwd_speedup": t_bwd / bwd, **ab}
                RESULTS["pix"].append(row)
                print(f"  {B}x{C}x{H}x{H:<6d} {row['dtype']:9s} {layout:6s} {fwd:7.4f} {f_fwd:7.4f} {fwd / f_fwd:5.2f} "
                      f"{t_fwd:7.4f} {t_fwd / fwd:5.1f} | {bwd:7.4f} {f_bwd:7.4f} {bwd / f_bwd:5.2f} {t_bwd:7.4f} "
                      f"{t_bwd / bwd:5.1f} | same-size copy {copy_fwd:.4f} / {copy_bwd:.4f} | over the issue's floor "
                      f"{row['fwd_over_issue_floor']:.2f} / {row['bwd_over_issue_floor']:.2f}"
                      + "".join(f" {k} {v:.4f}" for k, v in ab.items()), flush=True)


# ------------------------------------------------------------------------------------------ depthwise
def cudnn_best(fns, graph=True):
    out = []
    for flag in (False, True):
        torch.backends.cudnn.benchmark = flag
        out.append(bench(fns, graph=graph))
    torch.backends.cudnn.benchmark = False
    return min(out), out


def bench_depthwise(bw):
    print("== depthwise conv (N=16), ms; cuDNN = F.conv2d(groups=C), best of cudnn.benchmark off/on")
    print(f"  {'shape':18s} {'k':>2s} {'s':>2s} {'dtype':9s} {'layout':6s} {'fwd':>7s} {'cudnn':>7s} {'spd':>5s} | "
          f"{'fwd+bwd':>7s} {'cudnn':>7s} {'spd':>5s}")
    shapes = [(16, 32, 112, 3), (16, 144, 56, 3), (16, 240, 28, 5), (16, 480, 14, 3), (16, 480, 14, 5),
              (16, 672, 14, 5), (16, 1152, 7, 5), (16, 1152, 7, 3)]
    variants = [(torch.float32, "nchw", 1), (torch.float32, "nchw", 2), (torch.bfloat16, "nchw", 1),
                (torch.bfloat16, "nchw", 2), (torch.float32, "cl", 1), (torch.bfloat16, "cl", 1)]
    for dtype, layout, s in variants:
        fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
        for N, C, H, k in shapes:
            es = torch.tensor([], dtype=dtype).element_size()
            ho = (H + 2 * (k // 2) - k) // s + 1
            by = N * C * (H * H + ho * ho) * es
            n = nsets(by)
            xs = [torch.randn(N, C, H, H, device=DEV, dtype=dtype).contiguous(memory_format=fmt) for _ in range(n)]
            w = torch.randn(C, 1, k, k, device=DEV, dtype=dtype)
            ours = bench([lambda i=i: kernels.depthwise_conv2d(xs[i], w, None, s, k // 2) for i in range(n)])
            ref, ref_both = cudnn_best([lambda i=i: F.conv2d(xs[i], w, None, s, k // 2, 1, C) for i in range(n)])
            xr = [x.clone().requires_grad_(True) for x in xs]
            wr = w.clone().requires_grad_(True)
            dys = [torch.randn(N, C, ho, ho, device=DEV, dtype=dtype).contiguous(memory_format=fmt) for _ in range(n)]
            ours_fb = bench([lambda i=i: torch.autograd.grad(kernels.depthwise_conv2d(xr[i], wr, None, s, k // 2),
                                                             (xr[i], wr), dys[i]) for i in range(n)])
            ref_fb, ref_fb_both = cudnn_best([lambda i=i: torch.autograd.grad(F.conv2d(xr[i], wr, None, s, k // 2, 1, C),
                                                                              (xr[i], wr), dys[i]) for i in range(n)])
            extra = {}
            if layout == "cl":  # channels_last dispatches to cuDNN; our channels_last kernels, forced, for the record
                with env(COMPRESS_DW_CL_KERNEL="1"):
                    extra["kernel_fwd_ms"] = bench([lambda i=i: kernels.depthwise_conv2d(xs[i], w, None, s, k // 2)
                                                    for i in range(n)])
                    extra["kernel_fwd_bwd_ms"] = bench([lambda i=i: torch.autograd.grad(
                        kernels.depthwise_conv2d(xr[i], wr, None, s, k // 2), (xr[i], wr), dys[i]) for i in range(n)])
                extra["kernel_fwd_speedup"] = ref / extra["kernel_fwd_ms"]
                extra["kernel_fwd_bwd_speedup"] = ref_fb / extra["kernel_fwd_bwd_ms"]
            if s == 2 and layout == "nchw":  # A/B: register kernel without vector loads, with one output row per
                # thread (7x7-28x28 planes run the staged kernel whatever these say)
                for key, var, val in (("fwd_ms_vec_off", "COMPRESS_DW_VEC", "0"), ("fwd_ms_rows1", "COMPRESS_DW_ROWS", "1")):
                    with env(**{var: val}):
                        extra[key] = bench([lambda i=i: kernels.depthwise_conv2d(xs[i], w, None, s, k // 2)
                                            for i in range(n)])
            if layout == "nchw" and H <= 28:  # forward and forward+backward without the staged kernel
                with env(COMPRESS_DW_STAGED="0"):
                    extra["fwd_ms_staged_off"] = bench([lambda i=i: kernels.depthwise_conv2d(xs[i], w, None, s, k // 2)
                                                        for i in range(n)])
                    extra["fwd_bwd_ms_staged_off"] = bench([lambda i=i: torch.autograd.grad(
                        kernels.depthwise_conv2d(xr[i], wr, None, s, k // 2), (xr[i], wr), dys[i]) for i in range(n)])
            row = {"N": N, "C": C, "H": H, "W": H, "k": k, "stride": s, "dtype": str(dtype).replace("torch.", ""),
                   "layout": layout, "fwd_ms": ours, "cudnn_fwd_ms": ref, "cudnn_fwd_ms_bench_off_on": ref_both,
                   "fwd_bwd_ms": ours_fb, "cudnn_fwd_bwd_ms": ref_fb, "cudnn_fwd_bwd_ms_bench_off_on": ref_fb_both,
                   "fwd_speedup": ref / ours, "fwd_bwd_speedup": ref_fb / ours_fb,
                   "fwd_floor_ms": by / bw * 1e3, **extra}
            RESULTS["depthwise"].append(row)
            print(f"  {N}x{C}x{H}x{H:<8d} {k:2d} {s:2d} {row['dtype']:9s} {layout:6s} {ours:7.4f} {ref:7.4f} "
                  f"{ref / ours:5.2f} | {ours_fb:7.4f} {ref_fb:7.4f} {ref_fb / ours_fb:5.2f}"
                  + (f" | kernel {extra['kernel_fwd_ms']:.4f} {extra['kernel_fwd_bwd_ms']:.4f}" if extra.get("kernel_fwd_ms") else "")
                  + (f" | vec off {extra['fwd_ms_vec_off']:.4f} 1 row {extra['fwd_ms_rows1']:.4f}"
                     if "fwd_ms_vec_off" in extra else "")
                  + (f" | staged off {extra['fwd_ms_staged_off']:.4f} {extra['fwd_bwd_ms_staged_off']:.4f}"
                     if "fwd_ms_staged_off" in extra else ""), flush=True)


def bench_conv2d():
    print("== im2col conv2d, ms (speed reported, no target)")
    for N, C, Co, H, k, s, grp, dtype in ((32, 64, 64, 56, 3, 1, 1, torch.float32), (32, 128, 128, 28, 3, 1, 1, torch.float32),
                                         (32, 64, 64, 56, 3, 1, 1, torch.bfloat16), (32, 256, 256, 14, 3, 2, 1, torch.float32),
                                         (32, 128, 128, 28, 3, 1, 4, torch.float32)):
        x = torch.randn(N, C, H, H, device=DEV, dtype=dtype)
        w = torch.randn(Co, C // grp, k, k, device=DEV, dtype=dtype)
        b = torch.randn(Co, device=DEV, dtype=dtype)
        ours = bench([lambda: kernels.conv2d(x, w, b, s, k // 2, 1, grp)], min_calls=5, graph=False)
        ref, _ = cudnn_best([lambda: F.conv2d(x, w, b, s, k // 2, 1, grp)], graph=False)
        xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = F.conv2d(xr, wr, br, s, k // 2, 1, grp)
        dy = torch.randn_like(y)
        ours_fb = bench([lambda: torch.autograd.grad(kernels.conv2d(xr, wr, br, s, k // 2, 1, grp), (xr, wr, br), dy)],
                        min_calls=5, graph=False)
        ref_fb, _ = cudnn_best([lambda: torch.autograd.grad(F.conv2d(xr, wr, br, s, k // 2, 1, grp), (xr, wr, br), dy)],
                               graph=False)
        row = {"N": N, "C": C, "Co": Co, "H": H, "k": k, "stride": s, "groups": grp, "dtype": str(dtype).replace("torch.", ""),
               "fwd_ms": ours, "cudnn_fwd_ms": ref, "fwd_bwd_ms": ours_fb, "cudnn_fwd_bwd_ms": ref_fb}
        RESULTS["conv2d"].append(row)
        print(f"  {N}x{C}x{H}x{H} -> {Co} k{k} s{s} g{grp} {row['dtype']:9s} fwd {ours:.4f} (cudnn {ref:.4f}) "
              f"fwd+bwd {ours_fb:.4f} (cudnn {ref_fb:.4f})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu.json")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: correctness,pix,depthwise,conv2d")
    ap.add_argument("--pix-sizes", default="56,28,14,7", help="comma list of the PiX rows' plane sizes to time")
    args = ap.parse_args()
    require_cuda(__file__)
    # full float32 products in the references (set here, not on import: a test that imports this script keeps its
    # own process's settings)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    skip = set(filter(None, args.skip.split(",")))
    if _ext.load() is None:
        sys.exit("kernels_gpu.py: the CUDA extension did not build (see the messages above)")
    props = torch.cuda.get_device_properties(0)
    RESULTS["meta"] = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
                       "torch": torch.__version__, "cuda": torch.version.cuda,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "timing": "median of 30 CUDA-event timings of CUDA-graph replays (>=20 calls each, inputs rotated "
                                 "over sets totalling >= 4x L2), per call; conv2d and fwd_eager_ms: eager launches",
                       "floor": "bytes / max(eager memcpy, in-graph copy kernel) bandwidth of a 1 GiB copy; pix issue_floor_*: "
                                "bytes / the issue's example (0.086 ms for the 64x256x56x56 fp32 forward)",
                       "ab": "depthwise fwd_ms_vec_off: COMPRESS_DW_VEC=0 (no stride-2 vector loads); depthwise "
                             "fwd_ms_rows1: COMPRESS_DW_ROWS=1 (one output row per thread at stride 2); depthwise "
                             "fwd_ms_staged_off, fwd_bwd_ms_staged_off: COMPRESS_DW_STAGED=0 (no staged kernel for "
                             "7x7-28x28 planes; those planes ignore the two variables before); pix nchw "
                             "fwd/bwd_ms_steps*: COMPRESS_PIX_STEPS; pix nchw fwd/bwd_ms_stage_off: COMPRESS_PIX_STAGE=0 "
                             "(no warp-staged kernels for odd planes); pix cl bwd_ms_direct_off: "
                             "COMPRESS_PIX_CL_DIRECT=0 (chunk partials + a second launch for dp); pix cl "
                             "bwd_ms_gpt1: COMPRESS_PIX_CL_GPT=1; depthwise cl "
                             "rows: fwd_ms "
                             "is the default dispatch (cuDNN), kernel_*: our channels_last kernels forced "
                             "(COMPRESS_DW_CL_KERNEL=1)"}
    print(RESULTS["meta"])
    if "correctness" not in skip:
        correctness()
    bw = copy_bandwidth()
    print(f"== copy bandwidth: {bw / 1e12:.2f} TB/s (bytes read + written)")
    for name, fn in (("pix", lambda: bench_pix(bw, [int(v) for v in args.pix_sizes.split(",")])), ("depthwise", lambda: bench_depthwise(bw)), ("conv2d", bench_conv2d)):
        if name not in skip:
            try:
                fn()
            except Exception as e:  # keep the other sections' results
                RESULTS.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
                print(f"!! {name} failed: {type(e).__name__}: {e}", flush=True)
            with open(args.out, "w") as f:
                json.dump(RESULTS, f, indent=1)
    n_bad = sum(not r["ok"] for r in RESULTS["correctness"])
    RESULTS["correctness_failures"] = n_bad
    with open(args.out, "w") as f:
        json.dump(RESULTS, f, indent=1)
    print(f"correctness failures: {n_bad}; wrote {args.out}")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
