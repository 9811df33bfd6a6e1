#!/usr/bin/env python
"""Edge-case checks of the project's custom ops (kernels/) and modules (compress/) against float64 CPU references:
empty batches and channels, odd and 1-pixel maps, channel counts off the tile sizes, very wide layers, an input of
more than 2^31 elements (CUDA), sliced, transposed and misaligned inputs, masks with no, one or every stripe,
one-sided gradients, a side stream, inference mode and autocast, CUDAGraphModel's signature changes.
tests/test_edge_cases.py runs it (CPU in the default suite, CUDA under `pytest -m cuda`); by hand, from the repo root:
    python tests/edge_cases.py --device cuda --out edge_report.json
    python tests/edge_cases.py --device cpu  --out edge_cpu.json      # CUDA-only cases skipped
Options: --only SUBSTR (run cases whose name contains it; repeatable), --max-seconds (default 900: later cases are
recorded as skipped past it), --no-large (skip the > 2^31-element case), --list. Exit status 1 if a case failed.

Tolerances (max |out - ref| / max |ref|, ref = float64 on the CPU, written with plain torch ops):
  float64: 1e-9; float32: 1e-5, except on CUDA for ops that multiply-accumulate on tensor cores / cuDNN, where TF32
  may be on (the Triton stripe kernel rounds fp32 to TF32 by design, and cudnn.allow_tf32 is True by default): 1e-3;
  the im2col conv2d uses torch.matmul, so it gets 1e-3 only if torch.backends.cuda.matmul.allow_tf32 is True;
  float16 / bfloat16 (and autocast bf16): 1e-2. Gradients: the same tolerances, relative to the reference
  gradient's max |.| (a reduction of B*H*W terms, so 16-bit grads get 2e-2).
The CUDAGraphModel dtype cases pass when the wrapper raises as the eager model does, or matches it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEV = "cuda"
RESULTS: list[dict] = []
CASES: list[tuple[str, object, dict]] = []
HALF = (torch.float16, torch.bfloat16)


class Skip(Exception):
    pass


def case(name, **meta):
    def deco(fn):
        CASES.append((name, fn, meta))
        return fn
    return deco


def tol_for(dtype, tf32=False):
    if dtype == torch.float64:
        return 1e-9
    if dtype in HALF:
        return 1e-2
    return 1e-3 if (tf32 and DEV == "cuda") else 1e-5


def rel_err(out, ref):
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if tuple(out.shape) != tuple(ref.shape):
        raise AssertionError(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    if not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).sum().item()
        if not torch.equal(torch.isfinite(out), torch.isfinite(ref)):
            raise AssertionError(f"{bad} non-finite values in output")
        out, ref = torch.nan_to_num(out), torch.nan_to_num(ref)
    scale = ref.abs().max().item()
    return (out - ref).abs().max().item() / max(scale, 1e-30)


class Checker:
    """Collects (label, error, tol) comparisons of one case."""

    def __init__(self):
        self.items = []

    def cmp(self, label, out, ref, tol):
        e = rel_err(out, ref)
        self.items.append((label, e, tol))
        return e

    def expect(self, label, cond, msg=""):
        self.items.append((label, 0.0 if cond else float("inf"), 0.5))
        if not cond:
            self.items[-1] = (label + (": " + msg if msg else ""), float("inf"), 0.5)

    def verdict(self):
        fails = [(label, e, t) for label, e, t in self.items if not (e <= t)]
        worst = max((e / t for _, e, t in self.items), default=0.0)
        return fails, worst


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=gen(seed), dtype=torch.float64).to(dtype)


def to_dev(t, dtype):
    return t.to(DEV, dtype)


def layout(x, how):
    """x (already on DEV) re-laid out: nchw | cl | slice (channel slice of a wider tensor) | tposed (H/W transposed
    storage) | offset (contiguous, storage offset of 1 element: misaligned) | offset8 (8 elements)."""
    if how == "nchw":
        return x.contiguous()
    if how == "cl":
        if x.dim() == 4 and x.shape[1] == 1:  # contiguous(channels_last) keeps NCHW strides for C == 1
            B, _, H, W = x.shape
            return torch.empty_strided(x.shape, (H * W, 1, W, 1), dtype=x.dtype, device=x.device).copy_(x)
        return x.contiguous(memory_format=torch.channels_last)
    B, C, H, W = x.shape
    if how == "slice":
        big = torch.zeros(B, C + 3, H, W, dtype=x.dtype, device=x.device)
        big[:, 2:2 + C] = x
        return big[:, 2:2 + C]
    if how == "tposed":
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if how.startswith("offset"):
        k = 1 if how == "offset" else int(how[6:])
        flat = torch.zeros(x.numel() + k, dtype=x.dtype, device=x.device)
        flat[k:] = x.reshape(-1)
        return flat[k:].view(B, C, H, W)
    raise ValueError(how)


# ------------------------------------------------------------------------------------------ references
def ref_dense_from_stripes(w, oi, off, N, ks):
    """Independent zero-filled dense weight (N, C, KH, KW) from stripes (float64, differentiable in w)."""
    S, C = w.shape
    W = torch.zeros(N, C, ks[0], ks[1], dtype=w.dtype)
    if S:
        idx = (oi[:, None].expand(S, C), torch.arange(C)[None, :].expand(S, C), off[:, 0:1].expand(S, C),
               off[:, 1:2].expand(S, C))
        W = W.index_put(idx, w, accumulate=True)
    return W


def make_stripes(N, C, ks, mask_kind, seed):
    """(weight (S, C) float64, out_index, offset, mask (N, KH, KW) bool) in canonical order."""
    KH, KW = ks
    g = gen(seed)
    if mask_kind == "random":
        mask = torch.rand(N, KH, KW, generator=g) < 0.35
    elif mask_kind == "all_dead":
        mask = torch.zeros(N, KH, KW, dtype=torch.bool)
    elif mask_kind == "one":
        mask = torch.zeros(N, KH, KW, dtype=torch.bool)
        mask[N // 2, KH - 1, 0] = True
    elif mask_kind == "filters_dead":  # every other filter keeps nothing, the rest random
        mask = torch.rand(N, KH, KW, generator=g) < 0.5
        mask[::2] = False
    elif mask_kind == "all_kept":
        mask = torch.ones(N, KH, KW, dtype=torch.bool)
    elif mask_kind == "centre":
        mask = torch.zeros(N, KH, KW, dtype=torch.bool)
        mask[:, KH // 2, KW // 2] = torch.rand(N, generator=g) < 0.7
    else:
        raise ValueError(mask_kind)
    kh, kw, o = mask.permute(1, 2, 0).nonzero(as_tuple=True)
    S = o.numel()
    w = torch.randn(S, C, generator=g, dtype=torch.float64) / math.sqrt(max(1, C * KH * KW * 0.35))
    off = torch.stack([kh, kw], 1).long()
    return w, o.long(), off, mask


def ref_grad(yr, req, g):
    """float64 reference gradients; an input the reference does not use (no stripe kept) gets zeros."""
    gs = torch.autograd.grad(yr, req, g.double().cpu(), allow_unused=True)
    return [torch.zeros_like(t) if r is None else r for t, r in zip(req, gs)]


def run_grads(y, inputs, seed):
    """Gradients of (y * g).sum() for the tensors in inputs (None where not requiring grad); g in y's dtype."""
    g = rnd(tuple(y.shape), seed).to(y.device, y.dtype)
    req = [t for t in inputs if t is not None and t.requires_grad]
    if not req:
        return [None] * len(inputs), g
    gs = torch.autograd.grad(y, req, g, allow_unused=True)
    it = iter(gs)
    return [next(it) if (t is not None and t.requires_grad) else None for t in inputs], g


def cmp_grads(ck, y, yr, inputs, refs_in, names, seed, tol):
    """Compare the gradients of (y * g).sum() for the `inputs` that require grad against those of the float64
    reference yr for the matching `refs_in` (which require grad alike), each under its name in `names`."""
    got, g = run_grads(y, inputs, seed)
    asked = [i for i, (t, r) in enumerate(zip(inputs, refs_in)) if r.requires_grad]
    refs = ref_grad(yr, [refs_in[i] for i in asked], g)
    for i, ref in zip(asked, refs):
        ck.cmp(names[i], got[i], ref, tol)


# ------------------------------------------------------------------------------------------ stripe op
def stripe_case(name, B, C, N, H, W, ks=(3, 3), st=(1, 1), pd=(1, 1), dl=(1, 1), mask="random", dtype=torch.float32,
                lay="nchw", bias=True, relu=False, grad="", plan=True, dense=False, cuda_only=False, seed=0):
    """kernels.stripe_conv2d vs F.conv2d(float64) with the masked dense weight. grad: '' | 'x' | 'w' | 'xw'."""
    ks, st, pd, dl = (tuple(v) if isinstance(v, (tuple, list)) else (v, v) for v in (ks, st, pd, dl))

    @case(name, cuda_only=cuda_only)
    def _run(ck: Checker):
        import kernels
        w64, oi, off, _ = make_stripes(N, C, ks, mask, seed)
        x64 = rnd((B, C, H, W), seed + 1)
        b64 = rnd((N,), seed + 2) if bias else None
        # reference
        xr = x64.clone().requires_grad_("x" in grad)
        wr = w64.clone().requires_grad_("w" in grad)
        yr = F.conv2d(xr, ref_dense_from_stripes(wr, oi, off, N, ks), b64, st, pd, dl)
        yr_lin = yr
        if relu:  # (grads: the reference takes the ReLU mask of the op's own output: 16-bit rounding flips signs)
            yr = yr.relu()
        # op
        x = layout(to_dev(x64, dtype), lay).requires_grad_("x" in grad)
        w = to_dev(w64, dtype).requires_grad_("w" in grad)
        b = None if b64 is None else to_dev(b64, dtype)
        oid, offd = oi.to(DEV), off.to(DEV)
        pl = kernels.stripe_plan(oid, offd, N, ks) if plan else None
        dn = None
        if dense:
            with torch.no_grad():
                dn = kernels.stripe_to_dense(w, oid, offd, N, ks, memory_format=torch.channels_last)
        y = kernels.stripe_conv2d(x, w, oid, offd, b, N, ks, st, pd, dl, relu=relu, plan=pl, dense=dn)
        ck.expect("dtype", y.dtype == dtype, str(y.dtype))
        if C == 0:  # F.conv2d returns (B, 0, Ho, Wo) here; the definition gives the bias
            yr = (b64 if b64 is not None else torch.zeros(N, dtype=torch.float64))[None, :, None, None].expand(
                B, N, *yr.shape[2:])
            yr = yr.relu() if relu else yr
        ck.cmp("y", y, yr, tol_for(dtype, tf32=True))
        if lay == "cl" and C > 1 and H * W > 1:
            ck.expect("layout cl kept", y.is_contiguous(memory_format=torch.channels_last), str(y.stride()))
        if grad:
            (gx, gw), g = run_grads(y, [x, w], seed + 3)
            refs = dict(zip([k for k, t in (("x", xr), ("w", wr)) if t.requires_grad],
                            ref_grad(yr_lin if relu else yr, [t for t in (xr, wr) if t.requires_grad],
                                     g.double().cpu() * (y.detach().cpu() > 0).double() if relu else g)))
            gt = 2 * tol_for(dtype, tf32=True)
            if "x" in grad:
                ck.cmp("grad_x", gx, refs["x"], gt)
            if "w" in grad:
                ck.cmp("grad_w", gw, refs["w"], gt)
    return _run


# core geometry sweep (fp32, random mask, grads of both)
for nm, args in [
    ("b1", (1, 16, 16, 8, 8)),
    ("b0", (0, 16, 16, 8, 8)),
    ("b0_narrow", (0, 4, 8, 6, 6)),
    ("hw1x1_pad1", (2, 8, 12, 1, 1)),
    ("hw3x5", (2, 5, 17, 3, 5)),
    ("c1", (2, 1, 8, 6, 6)),
    ("c3_n40", (2, 3, 40, 9, 9)),
    ("c17_n24", (2, 17, 24, 9, 7)),
    ("c40_n129", (2, 40, 129, 6, 6)),
    ("c129_n40", (2, 129, 40, 5, 5)),
    ("n1", (2, 24, 1, 6, 6)),
]:
    stripe_case(f"stripe/{nm}/fp32/xw", *args, grad="xw")
stripe_case("stripe/7x7_s2/fp32/xw", 2, 16, 24, 7, 7, st=2, grad="xw")
stripe_case("stripe/7x7_s2_cl/bf16/xw", 2, 16, 24, 7, 7, st=2, lay="cl", dtype=torch.bfloat16, grad="xw")
stripe_case("stripe/dil2_s2/fp32/xw", 2, 17, 24, 11, 11, st=2, pd=2, dl=2, grad="xw")
stripe_case("stripe/dil3_s2_p3/fp16/xw", 2, 8, 16, 13, 12, st=2, pd=3, dl=3, dtype=torch.float16, grad="xw")
stripe_case("stripe/dil3_s1_p0/fp32/xw", 1, 8, 8, 11, 11, pd=0, dl=3, grad="xw")
stripe_case("stripe/k1x3_p01/fp32/xw", 2, 12, 20, 6, 9, ks=(1, 3), pd=(0, 1), grad="xw")
stripe_case("stripe/k3x1_p10_s21/fp32/xw", 2, 12, 20, 9, 6, ks=(3, 1), st=(2, 1), pd=(1, 0), grad="xw")
stripe_case("stripe/k5x5_p2_s2/fp32/xw", 2, 8, 16, 11, 10, ks=5, st=2, pd=2, grad="xw")
stripe_case("stripe/k5x5_p2/bf16_cl/xw", 2, 24, 32, 9, 9, ks=5, pd=2, lay="cl", dtype=torch.bfloat16, grad="xw")
stripe_case("stripe/k3_pad_gt_dil/fp32/xw", 2, 8, 8, 5, 5, pd=2, grad="xw")  # padding > d*(k-1)/2
stripe_case("stripe/1px_pad2_k5/fp32/xw", 2, 8, 8, 1, 1, ks=5, pd=2, grad="xw")
# masks
for mk in ("all_dead", "one", "filters_dead", "all_kept", "centre"):
    for dt, lay in ((torch.float32, "nchw"), (torch.bfloat16, "cl")):
        stripe_case(f"stripe/mask_{mk}/{str(dt)[6:]}_{lay}/xw", 2, 16, 24, 8, 8, mask=mk, dtype=dt, lay=lay,
                    grad="xw")
    stripe_case(f"stripe/mask_{mk}/fp16_dense_given", 2, 40, 48, 8, 8, mask=mk, dtype=torch.float16, dense=True)
stripe_case("stripe/mask_all_dead/relu_nobias", 2, 16, 24, 8, 8, mask="all_dead", relu=True, bias=False, grad="xw")
# dtypes x layouts
for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
    for lay in ("nchw", "cl", "slice", "tposed", "offset", "offset8"):
        stripe_case(f"stripe/layout_{lay}/{str(dt)[6:]}", 2, 24, 32, 7, 9, dtype=dt, lay=lay, relu=True,
                    grad="xw" if lay in ("cl", "slice") else "")
# requires_grad on one side only
for gs in ("x", "w"):
    for dt in (torch.float32, torch.bfloat16):
        stripe_case(f"stripe/grad_{gs}_only/{str(dt)[6:]}", 2, 16, 16, 8, 8, dtype=dt, grad=gs)
        stripe_case(f"stripe/grad_{gs}_only_wide/{str(dt)[6:]}", 2, 72, 80, 6, 6, dtype=dt, grad=gs)
stripe_case("stripe/no_plan/fp32/xw", 2, 16, 24, 8, 8, plan=False, grad="xw")
stripe_case("stripe/relu_s2_cl/fp16/xw", 2, 32, 40, 9, 9, st=2, relu=True, lay="cl", dtype=torch.float16, grad="xw")
# wide layers
stripe_case("stripe/wide_c1024_n1024/bf16", 2, 1024, 1024, 7, 7, dtype=torch.bfloat16, lay="cl")
stripe_case("stripe/wide_c1024_n1024/fp32", 1, 1024, 1024, 7, 7)
stripe_case("stripe/wide_c2048_n512_1x1/fp16", 2, 2048, 512, 4, 4, ks=1, pd=0, dtype=torch.float16, grad="xw")
stripe_case("stripe/wide_c2048_n256_dense/bf16", 1, 2048, 256, 5, 5, dtype=torch.bfloat16, dense=True)
stripe_case("stripe/c0", 2, 0, 8, 5, 5)


# ------------------------------------------------------------------------------------------ stripe misc (GPU)
@case("stripe/large_index_gt_2^31", cuda_only=True, large=True)
def _large(ck: Checker):
    """x of 2^31 + elements (bf16, 4.3 GB) whose pixel rows and channel planes are below 2^31: the op runs the
    Triton kernel (kernels.stripe._triton_fits), which offsets pixel rows in 64 bits. Compared on the last image's
    last rows (where 32-bit offsets would have wrapped)."""
    import kernels
    B, C, N, H, W = 35, 64, 16, 1000, 960
    assert B * C * H * W > 2**31
    w64, oi, off, _ = make_stripes(N, C, (3, 3), "random", 11)
    dt = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(B, H, W, C, device=DEV, dtype=dt).permute(0, 3, 1, 2)  # channels_last
    w = to_dev(w64, dt)
    oid, offd = oi.to(DEV), off.to(DEV)
    pl = kernels.stripe_plan(oid, offd, N, (3, 3))
    y = kernels.stripe_conv2d(x, w, oid, offd, None, N, (3, 3), 1, 1, 1, plan=pl)
    torch.cuda.synchronize()
    Wd = ref_dense_from_stripes(w.double().cpu(), oi, off, N, (3, 3))
    for b in (0, B - 1):
        for rows in ("top", "bottom"):
            if rows == "bottom":
                xs = x[b, :, H - 12:, :].double().cpu()[None]
                xs = F.pad(xs, (1, 1, 0, 1))
                yr = F.conv2d(xs, Wd)
                ck.cmp(f"y[{b}] bottom rows", y[b:b + 1, :, H - 11:, :], yr, 1e-2)
            else:
                xs = x[b, :, :12, :].double().cpu()[None]
                xs = F.pad(xs, (1, 1, 1, 0))
                yr = F.conv2d(xs, Wd)
                ck.cmp(f"y[{b}] top rows", y[b:b + 1, :, :11, :], yr, 1e-2)
    del x, y
    torch.cuda.empty_cache()


@case("stripe/nondefault_stream", cuda_only=True)
def _stream(ck: Checker):
    """The op, its kept launcher (prepare_stripe_conv2d, 1st and 2nd call: the compiled fast path) and the other
    C++ ops on a side stream whose input is written late (after a GPU sleep): a launch on the wrong stream reads
    zeros."""
    import kernels
    N, C = 24, 16
    w64, oi, off, _ = make_stripes(N, C, (3, 3), "random", 5)
    x64 = rnd((2, C, 8, 8), 6)
    yr = F.conv2d(x64, ref_dense_from_stripes(w64, oi, off, N, (3, 3)), None, 1, 1)
    src = to_dev(x64, torch.float32)
    w, oid, offd = to_dev(w64, torch.float32), oi.to(DEV), off.to(DEV)
    pl = kernels.stripe_plan(oid, offd, N, (3, 3))
    launch = kernels.prepare_stripe_conv2d(src, w, oid, offd, None, N, (3, 3), 1, 1, 1, plan=pl)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    outs = {}
    p64 = torch.rand(2, C // 4, 1, 1, generator=gen(3), dtype=torch.float64)
    dw64 = rnd((C, 1, 3, 3), 4)
    with torch.cuda.stream(s):
        for i in range(3):
            x = torch.zeros_like(src)
            torch.cuda._sleep(20_000_000)
            x.copy_(src)
            outs[f"op{i}"] = kernels.stripe_conv2d(x, w, oid, offd, None, N, (3, 3), 1, 1, 1, plan=pl)
            x2 = torch.zeros_like(src)
            torch.cuda._sleep(20_000_000)
            x2.copy_(src)
            if launch is not None:
                outs[f"launch{i}"] = launch(x2)
            x3 = torch.zeros_like(src)
            torch.cuda._sleep(20_000_000)
            x3.copy_(src)
            outs[f"pix{i}"] = kernels.pix(x3, p64.to(DEV, torch.float32), 4)
            outs[f"dw{i}"] = kernels.depthwise_conv2d(x3, dw64.to(DEV, torch.float32), None, 1, 1)
            outs[f"conv2d{i}"] = kernels.conv2d(x3, dw64.to(DEV, torch.float32).repeat(1, C, 1, 1), None, 1, 1)
    s.synchronize()
    xg = x64.unflatten(1, (C // 4, 4))
    pref = p64 * torch.where(p64 < 0.5, xg.amax(2), xg.mean(2))
    dref = F.conv2d(x64, dw64, None, 1, 1, 1, C)
    cref = F.conv2d(x64, dw64.repeat(1, C, 1, 1), None, 1, 1)
    for k, v in outs.items():
        ref = yr if k.startswith(("op", "launch")) else pref if k.startswith("pix") else dref if k.startswith("dw") \
            else cref
        ck.cmp(k, v, ref, tol_for(torch.float32, tf32=not k.startswith("pix")))
    ck.expect("launcher built", launch is not None)


@case("stripe/batch0_backward_narrow_triton", cuda_only=False)
def _b0_narrow(ck: Checker):
    """Batch 0 with weight grad on a narrow layer (C<=24, N<=32): on CUDA the Triton wgrad path
    (stripe_triton._grad_weight) computes slices = cdiv(M, m_per) with m_per = 0."""
    import kernels
    for C, N in ((4, 8), (16, 16)):
        w64, oi, off, _ = make_stripes(N, C, (3, 3), "random", 1)
        x = torch.zeros(0, C, 6, 6, device=DEV).requires_grad_()
        w = to_dev(w64, torch.float32).requires_grad_()
        y = kernels.stripe_conv2d(x, w, oi.to(DEV), off.to(DEV), None, N, 3, 1, 1, 1)
        y.sum().backward()
        ck.cmp(f"grad_w C{C}", w.grad, torch.zeros_like(w64), 1e-9)
        ck.expect(f"grad_x shape C{C}", tuple(x.grad.shape) == (0, C, 6, 6))


# ------------------------------------------------------------------------------------------ StripeConv2d module
def module_case(name, B, C, N, H, W, ks=3, st=1, pd=1, dl=1, mask="random", mode="stripe", dtype=torch.float32,
                lay="nchw", bias=True, relu=False, pool=False, pool_ceil=False, ctx="no_grad", grad="", seed=0,
                cuda_only=False):
    """compress.stripe.StripeConv2d.from_dense(conv, mask) in eval vs F.conv2d(float64) of conv.weight * mask.
    ctx: no_grad | inference_mode | grad | autocast_bf16 (then tol 1e-2, output bf16 expected)."""

    @case(name, cuda_only=cuda_only)
    def _run(ck: Checker):
        from compress.stripe import StripeConv2d
        ksz = ks if isinstance(ks, tuple) else (ks, ks)
        conv = nn.Conv2d(C, N, ksz, st, pd, dl, bias=bias).double()
        with torch.no_grad():
            conv.weight.copy_(rnd(conv.weight.shape, seed) / math.sqrt(C * ksz[0] * ksz[1] * 0.35))
            if bias:
                conv.bias.copy_(rnd((N,), seed + 1))
        _, _, _, m = make_stripes(N, C, ksz, mask, seed)
        x64 = rnd((B, C, H, W), seed + 2)
        wref = (conv.weight.detach() * m[:, None]).clone().requires_grad_("w" in grad)
        xr = x64.clone().requires_grad_("x" in grad)
        yr = F.conv2d(xr, wref, conv.bias, st, pd, dl)
        if relu:
            yr = yr.relu()
        if pool:
            yr = F.max_pool2d(yr, 2, ceil_mode=pool_ceil)
        mod = StripeConv2d.from_dense(conv.float(), m, mode=mode)
        mod.relu, mod.pool, mod.pool_ceil = relu, pool, pool_ceil
        mod = mod.to(DEV, dtype if ctx != "autocast_bf16" else torch.float32)
        mod.eval() if ctx != "grad" else mod.train()
        xin = layout(to_dev(x64, dtype if ctx != "autocast_bf16" else torch.float32), lay)
        xin.requires_grad_("x" in grad)
        outs = []
        for _ in range(2):  # second call: cached launcher / dense weight
            if ctx == "inference_mode":
                with torch.inference_mode():
                    y = mod(xin)
            elif ctx == "no_grad":
                with torch.no_grad():
                    y = mod(xin)
            elif ctx == "autocast_bf16":
                with torch.autocast(DEV, dtype=torch.bfloat16), torch.no_grad():
                    y = mod(xin)
            else:
                y = mod(xin)
            outs.append(y)
        edt = torch.bfloat16 if ctx == "autocast_bf16" else dtype
        for i, y in enumerate(outs):
            ck.cmp(f"y call{i}", y, yr, tol_for(edt, tf32=True))
        ck.expect("dtype", outs[0].dtype == edt, str(outs[0].dtype))
        if lay == "cl":
            ck.expect("channels_last out", outs[0].is_contiguous(memory_format=torch.channels_last),
                      str(outs[0].stride()))
        if grad:
            req = [t for t in (xr, wref) if t.requires_grad]
            (gx,), g = run_grads(outs[1], [xin], seed + 3) if "x" in grad else ((None,), None)
            if g is None:
                g = rnd(tuple(outs[1].shape), seed + 3).to(DEV, outs[1].dtype)
            refs = ref_grad(yr, req, g)
            k = 0
            if "x" in grad:
                ck.cmp("grad_x", gx, refs[k], 2 * tol_for(dtype, tf32=True))
                k += 1
            if "w" in grad:
                (gw,) = torch.autograd.grad(outs[1], [mod.weight], g) if "x" not in grad else \
                    torch.autograd.grad(mod(xin), [mod.weight], g)
                kh, kw, o = m.permute(1, 2, 0).nonzero(as_tuple=True)
                ck.cmp("grad_w", gw, refs[k][o, :, kh, kw], 2 * tol_for(dtype, tf32=True))
    return _run


for mode in ("stripe", "dense", "gemm"):
    for ctx in ("no_grad", "inference_mode", "autocast_bf16"):
        module_case(f"module/{mode}/{ctx}/b1_c17", 1, 17, 24, 6, 6, mode=mode, ctx=ctx, relu=True)
    module_case(f"module/{mode}/b0", 0, 16, 24, 6, 6, mode=mode)
    module_case(f"module/{mode}/all_dead_relu_pool", 2, 16, 24, 6, 6, mode=mode, mask="all_dead", relu=True,
                pool=True)
    module_case(f"module/{mode}/one_stripe_cl_bf16", 2, 16, 24, 6, 6, mode=mode, mask="one", lay="cl",
                dtype=torch.bfloat16)
    module_case(f"module/{mode}/c1_cl_fp16", 2, 1, 8, 7, 7, mode=mode, lay="cl", dtype=torch.float16)
    module_case(f"module/{mode}/pool_odd_ceil", 2, 8, 16, 7, 9, mode=mode, relu=True, pool=True, pool_ceil=True)
    module_case(f"module/{mode}/pool_even_s2", 2, 8, 16, 12, 12, st=2, mode=mode, relu=True, pool=True)
    module_case(f"module/{mode}/centre_trim_dil2", 2, 16, 24, 9, 9, pd=2, dl=2, mode=mode, mask="centre")
    module_case(f"module/{mode}/hw1_pad1_cl", 3, 32, 16, 1, 1, mode=mode, lay="cl")
    module_case(f"module/{mode}/slice_input", 2, 24, 16, 5, 5, mode=mode, lay="slice")
    module_case(f"module/{mode}/grad_xw", 2, 16, 24, 6, 6, mode=mode, ctx="grad", grad="xw")
    module_case(f"module/{mode}/grad_w_only_bf16", 2, 16, 24, 6, 6, mode=mode, ctx="grad", grad="w",
                dtype=torch.bfloat16)
    module_case(f"module/{mode}/grad_x_only_dead", 2, 16, 24, 6, 6, mode=mode, ctx="grad", grad="x",
                mask="all_dead")


@case("module/shape_change_same_module")
def _module_shapes(ck: Checker):
    """One eval StripeConv2d fed changing batch sizes, spatial sizes, layouts and dtypes (cached launcher, dense
    weight, unrolled weight keyed on the input)."""
    from compress.stripe import StripeConv2d
    conv = nn.Conv2d(16, 24, 3, 1, 1).double()
    _, _, _, m = make_stripes(24, 16, (3, 3), "random", 3)
    for mode in ("stripe", "dense", "gemm"):
        import copy
        mod = StripeConv2d.from_dense(copy.deepcopy(conv).float(), m, mode=mode).to(DEV).eval()
        wref = conv.weight.detach() * m[:, None]
        for i, (B, H, W, lay, dt) in enumerate([(2, 8, 8, "nchw", torch.float32), (1, 8, 8, "nchw", torch.float32),
                                                (2, 5, 7, "cl", torch.float32), (2, 8, 8, "nchw", torch.float32),
                                                (0, 8, 8, "nchw", torch.float32), (3, 4, 4, "cl", torch.float32)]):
            x64 = rnd((B, 16, H, W), 40 + i)
            with torch.no_grad():
                y = mod(layout(to_dev(x64, dt), lay))
            ck.cmp(f"{mode} call{i} {B}x{H}x{W} {lay}", y, F.conv2d(x64, wref, conv.bias.detach(), 1, 1),
                   tol_for(dt, tf32=True))
        # in-place weight update must invalidate caches
        with torch.no_grad():
            mod.weight.mul_(2)
            if mod.bias is not None:
                mod.bias.mul_(2)
            y = mod(to_dev(rnd((2, 16, 8, 8), 50), torch.float32))
        ck.cmp(f"{mode} after in-place weight*2", y,
               F.conv2d(rnd((2, 16, 8, 8), 50), 2 * wref, 2 * conv.bias.detach(), 1, 1), tol_for(torch.float32, True))


# ------------------------------------------------------------------------------------------ conv2d (im2col)
def conv2d_case(name, B, C, N, H, W, ks=3, st=1, pd=1, dl=1, groups=1, dtype=torch.float32, lay="nchw", bias=True,
                grad="", autocast=False, seed=0):
    @case(name)
    def _run(ck: Checker):
        import kernels
        ksz = ks if isinstance(ks, tuple) else (ks, ks)
        w64 = rnd((N, C // groups if groups else 0, *ksz), seed) / math.sqrt(max(1, C // max(groups, 1) * 9))
        x64 = rnd((B, C, H, W), seed + 1)
        b64 = rnd((N,), seed + 2) if bias else None
        xr, wr = x64.clone().requires_grad_("x" in grad), w64.clone().requires_grad_("w" in grad)
        yr = F.conv2d(xr, wr, b64, st, pd, dl, groups)  # (C == 0 is refused by the op: tests/test_kernels_conv2d.py)
        idt = torch.float32 if autocast else dtype
        x = layout(to_dev(x64, idt), lay).requires_grad_("x" in grad)
        w = to_dev(w64, idt).requires_grad_("w" in grad)
        b = None if b64 is None else to_dev(b64, idt)
        if autocast:
            with torch.autocast(DEV, dtype=torch.bfloat16):
                y = kernels.conv2d(x, w, b, st, pd, dl, groups)
        else:
            y = kernels.conv2d(x, w, b, st, pd, dl, groups)
        edt = torch.bfloat16 if autocast else dtype
        mm_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        ck.expect("dtype", y.dtype == edt, str(y.dtype))
        ck.cmp("y", y, yr, tol_for(edt, tf32=mm_tf32))
        if grad:
            cmp_grads(ck, y, yr, [x, w], [xr, wr], ["grad_x", "grad_w"], seed + 3,
                      2 * tol_for(edt, tf32=mm_tf32))
    return _run


conv2d_case("conv2d/b0/xw", 0, 8, 16, 6, 6, grad="xw")
conv2d_case("conv2d/b1_hw1_pad1/xw", 1, 5, 7, 1, 1, grad="xw")
conv2d_case("conv2d/hw3x5_s2_d2/xw", 2, 5, 17, 3, 5, st=2, pd=2, dl=2, grad="xw")
conv2d_case("conv2d/k1x3/xw", 2, 12, 20, 6, 9, ks=(1, 3), pd=(0, 1), grad="xw")
conv2d_case("conv2d/k5_s2_d3_p3/fp16/xw", 2, 8, 16, 13, 12, ks=5, st=2, pd=3, dl=3, dtype=torch.float16, grad="xw")
conv2d_case("conv2d/groups2_c40/bf16_cl/xw", 2, 40, 24, 7, 7, groups=2, dtype=torch.bfloat16, lay="cl", grad="xw")
conv2d_case("conv2d/groups_dw_c17/fp32_slice/xw", 2, 17, 17, 7, 7, groups=17, lay="slice", grad="xw")
conv2d_case("conv2d/tposed/fp32/x", 2, 8, 8, 6, 5, lay="tposed", grad="x")
conv2d_case("conv2d/offset1/fp16/w", 2, 8, 8, 6, 5, lay="offset", dtype=torch.float16, grad="w")
conv2d_case("conv2d/c1/fp32/xw", 2, 1, 3, 6, 6, grad="xw")
conv2d_case("conv2d/autocast_bf16", 2, 16, 24, 8, 8, autocast=True)
conv2d_case("conv2d/wide_c1024/bf16", 1, 1024, 256, 6, 6, dtype=torch.bfloat16)
conv2d_case("conv2d/fp64_cl/xw", 2, 8, 8, 5, 5, dtype=torch.float64, lay="cl", grad="xw")


# ------------------------------------------------------------------------------------------ depthwise
def dw_case(name, B, C, H, W, ks=3, st=1, pd=1, dl=1, dtype=torch.float32, lay="nchw", bias=True, grad="",
            autocast=False, seed=0):
    @case(name)
    def _run(ck: Checker):
        import kernels
        ksz = ks if isinstance(ks, tuple) else (ks, ks)
        w64 = rnd((C, 1, *ksz), seed) / math.sqrt(9)
        x64 = rnd((B, C, H, W), seed + 1)
        b64 = rnd((C,), seed + 2) if bias else None
        xr, wr = x64.clone().requires_grad_("x" in grad), w64.clone().requires_grad_("w" in grad)
        yr = F.conv2d(xr, wr, b64, st, pd, dl, C) if C else torch.zeros(B, 0, H + 2 * pd - 2 * dl * (ksz[0] - 1) // 2,
                                                                          W + 2 * pd - 2 * dl * (ksz[1] - 1) // 2)
        idt = torch.float32 if autocast else dtype
        x = layout(to_dev(x64, idt), lay).requires_grad_("x" in grad)
        w = to_dev(w64, idt).requires_grad_("w" in grad)
        b = None if b64 is None else to_dev(b64, idt)
        if autocast:
            with torch.autocast(DEV, dtype=torch.bfloat16):
                y = kernels.depthwise_conv2d(x, w, b, st, pd, dl)
        else:
            y = kernels.depthwise_conv2d(x, w, b, st, pd, dl)
        edt = torch.bfloat16 if autocast else dtype
        ck.expect("dtype", y.dtype == edt, str(y.dtype))
        ck.cmp("y", y, yr, tol_for(edt, tf32=True))
        if lay == "cl" and C > 1 and H * W > 1:
            ck.expect("layout cl kept", y.is_contiguous(memory_format=torch.channels_last), str(y.stride()))
        if grad:
            cmp_grads(ck, y, yr, [x, w], [xr, wr], ["grad_x", "grad_w"], seed + 3, 2 * tol_for(edt, tf32=True))
    return _run


for dt in (torch.float32, torch.float16, torch.bfloat16):
    s = str(dt)[6:]
    for lay in ("nchw", "cl"):
        dw_case(f"dw/k3_s2_odd7/{s}_{lay}/xw", 2, 17, 7, 7, st=2, dtype=dt, lay=lay, grad="xw")
        dw_case(f"dw/k5_s1_3x5/{s}_{lay}/xw", 2, 5, 3, 5, ks=5, pd=2, dtype=dt, lay=lay, grad="xw")
        dw_case(f"dw/k7_s2_p3/{s}_{lay}/xw", 2, 40, 13, 11, ks=7, st=2, pd=3, dtype=dt, lay=lay, grad="xw")
    dw_case(f"dw/dil2_s2/{s}/xw", 2, 24, 11, 11, st=2, pd=2, dl=2, dtype=dt, grad="xw")
    dw_case(f"dw/dil3/{s}_cl/xw", 2, 24, 11, 11, pd=3, dl=3, dtype=dt, lay="cl", grad="xw")
    dw_case(f"dw/k1x3/{s}/xw", 2, 16, 6, 9, ks=(1, 3), pd=(0, 1), dtype=dt, grad="xw")
    dw_case(f"dw/k3x1_s21/{s}_cl/xw", 2, 16, 9, 6, ks=(3, 1), st=(2, 1), pd=(1, 0), dtype=dt, lay="cl", grad="xw")
dw_case("dw/b0/xw", 0, 8, 6, 6, grad="xw")
dw_case("dw/b0_cl/bf16", 0, 8, 6, 6, lay="cl", dtype=torch.bfloat16)
dw_case("dw/b1_hw1_pad1/xw", 1, 16, 1, 1, grad="xw")
dw_case("dw/b1_hw1_pad1_cl/fp16/xw", 1, 32, 1, 1, lay="cl", dtype=torch.float16, grad="xw")
dw_case("dw/c1/xw", 2, 1, 8, 8, grad="xw")
dw_case("dw/c3_cl/xw", 2, 3, 8, 8, lay="cl", grad="xw")
dw_case("dw/c129_s2/bf16_cl/xw", 2, 129, 9, 9, st=2, lay="cl", dtype=torch.bfloat16, grad="xw")
dw_case("dw/c2048/fp16_cl", 2, 2048, 7, 7, lay="cl", dtype=torch.float16)
dw_case("dw/c1024_s2/fp32/xw", 2, 1024, 8, 8, st=2, grad="xw")
dw_case("dw/slice/fp32/xw", 2, 24, 8, 8, lay="slice", grad="xw")
dw_case("dw/tposed/fp16/x", 2, 24, 8, 6, lay="tposed", dtype=torch.float16, grad="x")
dw_case("dw/offset1/fp16", 2, 24, 8, 8, lay="offset", dtype=torch.float16)
dw_case("dw/offset1_cl/bf16/w", 2, 24, 8, 8, lay="offset", dtype=torch.bfloat16, grad="w")
dw_case("dw/grad_w_only/fp32", 2, 32, 16, 16, grad="w")
dw_case("dw/grad_x_only_s2/fp32", 2, 32, 16, 16, st=2, grad="x")
dw_case("dw/autocast_bf16", 2, 32, 8, 8, autocast=True)
dw_case("dw/fp64/xw", 2, 8, 5, 5, dtype=torch.float64, grad="xw")
dw_case("dw/pad_gt_k/xw", 2, 8, 4, 4, pd=3, grad="xw")


# ------------------------------------------------------------------------------------------ pix / pix_squeeze
def pix_ref(x, p, zeta, tau):
    """The op's definition: the max branch's gradient goes to the FIRST arg-max channel of a group only."""
    xg = x.unflatten(1, (x.shape[1] // zeta, zeta))
    if xg.numel() == 0:
        return p * torch.where(p < tau, xg.sum(2), xg.mean(2))
    mx = xg.gather(2, xg.detach().argmax(2, keepdim=True)).squeeze(2)
    return p * torch.where(p < tau, mx, xg.mean(2))


def pix_case(name, B, C, H, W, zeta, dtype=torch.float32, lay="nchw", grad="", tau=0.5, seed=0):
    @case(name)
    def _run(ck: Checker):
        import kernels
        G = C // zeta if zeta else 0
        x64 = rnd((B, C, H, W), seed)
        p64 = torch.rand(B, G, 1, 1, generator=gen(seed + 1), dtype=torch.float64)
        # keep p away from tau (the test runs in x's dtype) except an exact tie (p == tau takes the mean)
        p64 = torch.where((p64 - tau).abs() < 0.02, p64 + 0.05, p64).clamp(0, 1)
        if p64.numel():
            p64.view(-1)[0] = tau
        xr, pr = x64.clone().requires_grad_("x" in grad), p64.clone().requires_grad_("p" in grad)
        yr = pix_ref(xr, pr, zeta, tau)
        x = layout(to_dev(x64, dtype), lay).requires_grad_("x" in grad)
        p = to_dev(p64, dtype).requires_grad_("p" in grad)
        y = kernels.pix(x, p, zeta, tau)
        ck.cmp("y", y, yr, tol_for(dtype))
        if grad:
            cmp_grads(ck, y, yr, [x, p], [xr, pr], ["grad_x", "grad_p"], seed + 3, 2 * tol_for(dtype))
    return _run


for dt in (torch.float32, torch.float16, torch.bfloat16):
    s = str(dt)[6:]
    for lay in ("nchw", "cl", "slice", "offset"):
        pix_case(f"pix/z4_c40_3x5/{s}_{lay}/xp", 2, 40, 3, 5, 4, dtype=dt, lay=lay, grad="xp")
    pix_case(f"pix/z1/{s}/xp", 2, 17, 5, 5, 1, dtype=dt, grad="xp")
    pix_case(f"pix/z3_c129_cl/{s}/xp", 2, 129, 3, 3, 3, dtype=dt, lay="cl", grad="xp")
    pix_case(f"pix/G1_z5/{s}/xp", 2, 5, 7, 7, 5, dtype=dt, grad="xp")
    pix_case(f"pix/hw1_cl/{s}/xp", 3, 32, 1, 1, 2, dtype=dt, lay="cl", grad="xp")
pix_case("pix/b0/xp", 0, 16, 4, 4, 2, grad="xp")
pix_case("pix/b1_wide2048_cl/bf16", 1, 2048, 7, 7, 2, dtype=torch.bfloat16, lay="cl")
pix_case("pix/c0", 2, 0, 4, 4, 2)
pix_case("pix/hw0", 2, 8, 0, 4, 2)
pix_case("pix/fp64_cl/xp", 2, 8, 3, 3, 2, dtype=torch.float64, lay="cl", grad="xp")
pix_case("pix/grad_p_only/fp16", 2, 16, 4, 4, 4, dtype=torch.float16, grad="p")
pix_case("pix/grad_x_only_tposed/fp32", 2, 16, 4, 6, 4, lay="tposed", grad="x")


def squeeze_ref(x, w, zeta, tau, dtype):
    B, C = x.shape[:2]
    pooled = x.mean((2, 3))
    p = torch.sigmoid(pooled @ w.reshape(w.shape[0], C).t())[:, :, None, None]
    return pix_ref(x, p, zeta, tau), p


def squeeze_weight(B, C, zeta, tau, x64, seed, dtype):
    """A predictor whose p stays >= 0.02 from tau (also after rounding p to dtype): no branch flip between the
    float64 reference and the kernel."""
    G = C // zeta
    for k in range(50):
        w = rnd((G, C, 1, 1), seed + 100 * k) * (3.0 / math.sqrt(max(C, 1))) * math.sqrt(max(x64.shape[2] * x64.shape[3], 1))
        if B == 0 or C == 0:
            return w
        _, p = squeeze_ref(x64, w, zeta, tau, dtype)
        if ((p - tau).abs() > 0.02).all():
            return w
    raise Skip("no predictor with p away from tau")


def squeeze_case(name, B, C, H, W, zeta, dtype=torch.float32, lay="nchw", grad="", via_residual=False,
                 ctx="grad", tau=0.5, seed=0):
    """kernels.pix_squeeze (eager fast paths included); via_residual: x = residual_relu(a, b) first (CUDA keeps
    the channel mean on x), optionally modified in place before the squeeze ('inplace')."""

    @case(name)
    def _run(ck: Checker):
        import kernels
        a64, b64 = rnd((B, C, H, W), seed), rnd((B, C, H, W), seed + 1)
        if dtype in HALF:  # values exact in 16 bits, and their sums too (else a near-tie's arg-max flips)
            a64, b64 = (a64 * 8).round().clamp(-24, 24) / 8, (b64 * 8).round().clamp(-24, 24) / 8
        x64 = (a64 + b64).relu() if via_residual else a64
        if via_residual == "inplace":
            x64 = x64 * 2 + 0.25
        w64 = squeeze_weight(B, C, zeta, tau, x64, seed + 2, dtype)
        if via_residual:
            ar = a64.clone().requires_grad_("x" in grad)
            xr = (ar + b64).relu()
            if via_residual == "inplace":
                xr = xr * 2 + 0.25
        else:
            ar = xr = x64.clone().requires_grad_("x" in grad)
        wr = w64.clone().requires_grad_("w" in grad)
        yr, _ = squeeze_ref(xr, wr, zeta, tau, dtype)

        def fwd():
            a = layout(to_dev(a64, dtype), lay).requires_grad_("x" in grad)
            w = to_dev(w64, dtype).requires_grad_("w" in grad)
            if via_residual:
                b = layout(to_dev(b64, dtype), lay)
                x = kernels.residual_relu(a.clone() if a.requires_grad else a, b)
                if via_residual == "inplace":
                    x = x.mul(2) if x.requires_grad else x.mul_(2)
                    x = x.add_(0.25)
            else:
                x = a
            return a, w, kernels.pix_squeeze(x, w, zeta, tau)

        if ctx == "inference_mode":
            with torch.inference_mode():
                a, w, y = fwd()
        elif ctx == "no_grad":
            with torch.no_grad():
                a, w, y = fwd()
        else:
            a, w, y = fwd()
        ck.cmp("y", y, yr, tol_for(dtype))
        if grad:
            cmp_grads(ck, y, yr, [a, w], [ar, wr], ["grad_x", "grad_w"], seed + 3, 2 * tol_for(dtype))
    return _run


for dt in (torch.float32, torch.float16, torch.bfloat16):
    s = str(dt)[6:]
    for lay in ("nchw", "cl"):
        squeeze_case(f"pix_squeeze/c40_z4_3x5/{s}_{lay}/xw", 2, 40, 3, 5, 4, dtype=dt, lay=lay, grad="xw")
        squeeze_case(f"pix_squeeze/resid/{s}_{lay}/xw", 2, 32, 5, 5, 2, dtype=dt, lay=lay, grad="xw",
                     via_residual=True)
        squeeze_case(f"pix_squeeze/resid_inplace/{s}_{lay}/nograd", 2, 32, 5, 5, 2, dtype=dt, lay=lay,
                     via_residual="inplace", ctx="no_grad")
        squeeze_case(f"pix_squeeze/resid_inplace/{s}_{lay}/inference_mode", 2, 32, 5, 5, 2, dtype=dt, lay=lay,
                     via_residual="inplace", ctx="inference_mode")
    squeeze_case(f"pix_squeeze/hw1_c129_z3/{s}/xw", 2, 129, 1, 1, 3, dtype=dt, grad="xw")
    squeeze_case(f"pix_squeeze/slice/{s}/x", 2, 24, 4, 4, 2, dtype=dt, lay="slice", grad="x")
    squeeze_case(f"pix_squeeze/offset1/{s}/w", 2, 24, 4, 4, 2, dtype=dt, lay="offset", grad="w")
squeeze_case("pix_squeeze/b0/xw", 0, 16, 4, 4, 2, grad="xw")
squeeze_case("pix_squeeze/b0_resid/nograd", 0, 16, 4, 4, 2, via_residual=True, ctx="no_grad")
squeeze_case("pix_squeeze/z1/fp32/xw", 2, 8, 3, 3, 1, grad="xw")


@case("residual_relu/edge")
def _rr(ck: Checker):
    """residual_relu vs relu(a + b): mixed layouts, non-contiguous, batch 0, 16-bit, grads."""
    import kernels
    for i, (shape, dt, la, lb, grad) in enumerate([
            ((2, 17, 3, 5), torch.float32, "nchw", "nchw", True), ((2, 17, 3, 5), torch.float16, "cl", "cl", True),
            ((2, 16, 4, 4), torch.bfloat16, "nchw", "cl", True), ((2, 16, 4, 4), torch.float32, "cl", "slice", False),
            ((0, 16, 4, 4), torch.float32, "nchw", "nchw", True), ((0, 16, 4, 4), torch.float16, "cl", "cl", False),
            ((1, 2048, 1, 1), torch.bfloat16, "cl", "cl", False), ((2, 8, 0, 3), torch.float32, "nchw", "nchw", False),
            ((2, 24, 5, 5), torch.float16, "offset", "offset", True), ((2, 3, 6, 6), torch.float32, "tposed", "nchw", True)]):
        a64, b64 = rnd(shape, i), rnd(shape, i + 50)
        ar, br = a64.clone().requires_grad_(grad), b64.clone().requires_grad_(grad)
        yr = (ar + br).relu()
        a = layout(to_dev(a64, dt), la).requires_grad_(grad)
        b = layout(to_dev(b64, dt), lb).requires_grad_(grad)
        y = kernels.residual_relu(a.clone() if grad else a, b)
        ck.cmp(f"case{i} y {shape} {la}/{lb}", y, yr, tol_for(dt))
        if grad:
            (ga, gb), g = run_grads(y, [a, b], i + 7)
            ra, rb = torch.autograd.grad(yr, [ar, br], g.double().cpu())
            ck.cmp(f"case{i} grad_a", ga, ra, tol_for(dt))
            ck.cmp(f"case{i} grad_b", gb, rb, tol_for(dt))


# ------------------------------------------------------------------------------------------ max_pool2d
@case("max_pool2d/edge")
def _pool(ck: Checker):
    import kernels
    from compress.pooling import MaxPool2d
    for i, (shape, k, s, p, d, ceil, dt, lay) in enumerate([
            ((2, 5, 7, 7), 2, 2, 0, 1, False, torch.float32, "nchw"), ((2, 5, 7, 7), 2, 2, 0, 1, True, torch.float32, "cl"),
            ((2, 3, 3, 5), 3, 2, 1, 1, True, torch.float16, "nchw"), ((1, 17, 1, 1), 2, 2, 1, 1, False, torch.float32, "nchw"),
            ((1, 17, 1, 1), 1, 1, 0, 1, False, torch.bfloat16, "cl"), ((0, 8, 4, 4), 2, 2, 0, 1, False, torch.float32, "nchw"),
            ((2, 8, 9, 9), 3, 2, 1, 2, False, torch.float32, "slice"), ((2, 8, 9, 9), (1, 3), (2, 1), (0, 1), 1, True, torch.float32, "tposed"),
            ((2, 129, 6, 6), 2, None, 0, 1, False, torch.float64, "offset"), ((2, 1, 6, 6), 3, 3, 1, 1, True, torch.float32, "cl")]):
        x64 = rnd(shape, i)
        if x64.numel():
            x64.view(-1)[3] = -float("inf")
        yr = F.max_pool2d(x64, k, s, p, d, ceil_mode=ceil)
        x = layout(to_dev(x64, dt), lay)
        for ctxn in ("no_grad", "grad"):
            xx = x.detach().requires_grad_(ctxn == "grad")
            with torch.set_grad_enabled(ctxn == "grad"):
                y = kernels.max_pool2d(xx, k, s, p, d, ceil)
            ck.cmp(f"case{i} {ctxn}", y, yr, tol_for(dt))
        m = MaxPool2d(k, s, p, d, ceil_mode=ceil).eval()
        with torch.no_grad():
            ck.cmp(f"case{i} module", m(x), yr, tol_for(dt))


# ------------------------------------------------------------------------------------------ CUDAGraphModel
def _compact_model(seed=0):
    from compress.pix import PiXBlock
    from compress.stripe import StripeConv2d
    torch.manual_seed(seed)
    c1, c2 = nn.Conv2d(3, 16, 3, 1, 1), nn.Conv2d(16, 24, 3, 2, 1)
    _, _, _, m1 = make_stripes(16, 3, (3, 3), "random", seed)
    _, _, _, m2 = make_stripes(24, 16, (3, 3), "filters_dead", seed + 1)
    s1 = StripeConv2d.from_dense(c1, m1, "stripe")
    s1.relu = True
    s2 = StripeConv2d.from_dense(c2, m2, "gemm")
    model = nn.Sequential(s1, nn.MaxPool2d(2, ceil_mode=True), s2, nn.ReLU(), PiXBlock(24, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    return model.eval()


@case("graphs/changing_shapes_dtypes")
def _graphs(ck: Checker):
    """CUDAGraphModel on a compact model (StripeConv2d stripe/gemm modes, PiXBlock), against the float64 model
    on the CPU: changing batch sizes, spatial sizes, layouts, a non-contiguous input, a batch of 0, a repeated
    signature after others (LRU), then input dtype changes (fp16/bf16 into an fp32 model: must raise as the eager
    model does, or match it), autocast bf16, a half() model, and a CPU input."""
    import copy

    from compress.graphs import CUDAGraphModel
    model = _compact_model().to(DEV)
    ref_model = copy.deepcopy(model).to("cpu", torch.float64)
    fast = CUDAGraphModel(model, max_graphs=3)
    seq = [((4, 3, 16, 16), "nchw"), ((1, 3, 16, 16), "nchw"), ((4, 3, 15, 13), "nchw"), ((4, 3, 16, 16), "cl"),
           ((2, 3, 16, 16), "slice"), ((4, 3, 16, 16), "nchw"), ((3, 3, 9, 9), "nchw"), ((4, 3, 16, 16), "nchw"),
           ((0, 3, 16, 16), "nchw")]
    for i, (shape, lay) in enumerate(seq):
        x64 = rnd(shape, 100 + i)
        with torch.no_grad():
            yr = ref_model(x64)
        try:
            y = fast(layout(to_dev(x64, torch.float32), lay))
            ck.cmp(f"call{i} {shape} {lay}", y, yr, tol_for(torch.float32, tf32=True))
        except Exception as e:  # noqa: BLE001
            ck.expect(f"call{i} {shape} {lay}", False, f"{type(e).__name__}: {e}"[:300])
    # dtype changes
    for i, (dt, ac) in enumerate([(torch.float16, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)]):
        x = to_dev(rnd((2, 3, 16, 16), 200 + i), dt)
        eager_err = graph_err = None
        ye = yg = None
        try:
            with torch.no_grad(), torch.autocast(DEV, dtype=ac or torch.float16, enabled=ac is not None):
                ye = model(x)
        except Exception as e:  # noqa: BLE001
            eager_err = f"{type(e).__name__}: {e}"[:200]
        try:
            with torch.autocast(DEV, dtype=ac or torch.float16, enabled=ac is not None):
                yg = fast(x)
        except Exception as e:  # noqa: BLE001
            graph_err = f"{type(e).__name__}: {e}"[:200]
        label = f"dtype {dt} autocast {ac}"
        if eager_err is not None:
            ck.expect(label + " raises like eager", graph_err is not None, f"eager raised {eager_err}, graph returned")
        else:
            ck.expect(label + " runs like eager", graph_err is None, f"graph raised {graph_err}")
            if yg is not None:
                ck.cmp(label + " graph vs eager", yg, ye, 1e-2)
                with torch.no_grad():
                    yr = ref_model(x.double().cpu())
                ck.cmp(label + " graph vs ref", yg, yr, 3e-2)
    # half model through .half() (the wrapper must reset)
    fast.half()
    x64 = rnd((2, 3, 16, 16), 300)
    with torch.no_grad():
        yr = ref_model(x64)
    try:
        ck.cmp("half() model, fp16 input", fast(to_dev(x64, torch.float16)), yr, 3e-2)
    except Exception as e:  # noqa: BLE001
        ck.expect("half() model, fp16 input", False, f"{type(e).__name__}: {e}"[:300])
    # CPU input: runs eagerly
    cpu_fast = CUDAGraphModel(_compact_model().float())
    ck.cmp("cpu input eager", cpu_fast(x64.float()), copy.deepcopy(cpu_fast.model).double()(x64), 1e-4)


@case("graphs/no_grad_inference_mode_outputs")
def _graphs_modes(ck: Checker):
    from compress.graphs import CUDAGraphModel
    model = _compact_model(1).to(DEV)
    ref = _compact_model(1).double()
    fast = CUDAGraphModel(model)
    x64 = rnd((4, 3, 12, 12), 7)
    with torch.no_grad():
        yr = ref(x64)
    for ctxn in ("plain", "no_grad", "inference_mode", "plain"):
        cm = torch.inference_mode() if ctxn == "inference_mode" else torch.no_grad() if ctxn == "no_grad" \
            else torch.enable_grad()
        with cm:
            y = fast(to_dev(x64, torch.float32))
        ck.cmp(f"{ctxn}", y, yr, tol_for(torch.float32, tf32=True))
        ck.expect(f"{ctxn} no grad", not y.requires_grad)
    y1 = fast(to_dev(x64, torch.float32))
    y2 = fast(to_dev(rnd((4, 3, 12, 12), 8), torch.float32))
    ck.cmp("output not overwritten by next call (copy_output)", y1, yr, tol_for(torch.float32, tf32=True))
    del y2


# ------------------------------------------------------------------------------------------ driver
def main():
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default="edge_gpu_report.json")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--max-seconds", type=float, default=900.0)
    ap.add_argument("--no-large", action="store_true")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    DEV = a.device
    if a.list:
        for n, _, meta in CASES:
            print(n, meta or "")
        return 0
    if DEV == "cuda" and not torch.cuda.is_available():
        print("CUDA not available; use --device cpu", file=sys.stderr)
        return 2
    t0 = time.time()
    env = dict(torch=torch.__version__, device=DEV, cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
               matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32, cwd=os.getcwd())
    if DEV == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(json.dumps(env))
    # the large case first among the CUDA ones would cost its memory early; run it right after the cheap cases
    order = [c for c in CASES if not c[2].get("large")]
    large = [c for c in CASES if c[2].get("large")]
    order = order[: len(order) // 2] + large + order[len(order) // 2:]
    for name, fn, meta in order:
        if a.only and not any(s in name for s in a.only):
            continue
        rec = dict(name=name, status="pass", max_err_over_tol=None, error=None, details=None, seconds=None)
        t1 = time.time()
        try:
            if time.time() - t0 > a.max_seconds:
                raise Skip(f"time budget {a.max_seconds}s spent")
            if meta.get("cuda_only") and DEV != "cuda":
                raise Skip("CUDA-only case")
            if meta.get("large") and a.no_large:
                raise Skip("--no-large")
            ck = Checker()
            fn(ck)
            if DEV == "cuda":
                torch.cuda.synchronize()
            fails, worst = ck.verdict()
            rec["max_err_over_tol"] = worst
            rec["details"] = [f"{label}: err={e:.3g} tol={t:.0e}" for label, e, t in ck.items]
            if fails:
                rec["status"] = "fail"
                rec["error"] = "; ".join(f"{label}: err={e:.3g} > tol={t:.0e}" for label, e, t in fails)[:2000]
        except Skip as e:
            rec["status"], rec["error"] = "skip", str(e)
        except Exception as e:  # noqa: BLE001
            rec["status"] = "fail"
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
            if DEV == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception as e2:  # noqa: BLE001  (a sticky CUDA error: later cases will fail too)
                    rec["error"] += f" | CUDA context broken: {e2}"
        rec["seconds"] = round(time.time() - t1, 3)
        RESULTS.append(rec)
        if rec["status"] == "fail":
            print(f"FAIL {name}: {rec['error']}", flush=True)
    counts = {k: sum(r["status"] == k for r in RESULTS) for k in ("pass", "fail", "skip")}
    summary = dict(env=env, counts=counts, total=len(RESULTS), seconds=round(time.time() - t0, 1),
                   failures=[r["name"] for r in RESULTS if r["status"] == "fail"])
    with open(a.out, "w") as f:
        json.dump(dict(summary=summary, results=RESULTS), f, indent=1, default=str)
    print(json.dumps(summary, indent=1))
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
