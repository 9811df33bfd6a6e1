"""Triton GPU forward of ``compress::stripe_conv2d``: a fused implicit GEMM on tensor cores.

Route (b) of DESIGN.md. A program owns BLOCK_M output pixels x BLOCK_N output channels [n0, n0+BLOCK_N).
For each kernel offset k, the stripes of offset k whose output channel is in the tile are the contiguous
range ``[plan[k, n0], plan[k, n0+BLOCK_N])`` of the canonical order (see ``kernels.stripe`` for the plan).
They are taken CHUNK at a time (all of one offset, so they share one shifted input tile A_k):

    P[M, CHUNK]    = A_k[M, C] @ W[chunk, C]^T        (tensor cores, fp32 accumulate)
    acc[M, BLOCK_N] += P @ R[CHUNK, BLOCK_N]           (R one-hot: stripe -> its output channel column)

so per-stripe results never leave registers. Epilogue: bias, optional ReLU, store in the output's layout
(NCHW or channels_last; the input is read channels_last, an NCHW input is converted first).
float32 inputs use TF32 tensor cores with round-to-nearest operands, and P is split into two TF32 parts
for the one-hot reduction, so the result stays within ~1e-4 relative of float32.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None

from kernels._utils import memory_format


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``x`` (CUDA, float32/16/bf16, triton importable)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


if triton is not None:

    @triton.jit
    def _round_tf32(v):
        # round-to-nearest to TF32 (10 mantissa bits) so that tensor-core truncation adds no bias
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x1000) & -8192  # -8192 == 0xFFFFE000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _stripe_fwd_kernel(
        x_ptr, w_ptr, oi_ptr, plan_ptr, b_ptr, y_ptr,
        M, C, H, W, Ho, Wo, N,
        sy_b, sy_c, sy_h, sy_w,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        HAS_BIAS: tl.constexpr, RELU: tl.constexpr, IS_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
        ONE_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        n1 = tl.minimum(n0 + BLOCK_N, N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        jw = offs_m % Wo
        t = offs_m // Wo
        ih0 = (t % Ho) * SH - PH
        iw0 = jw * SW - PW
        bb = (t // Ho).to(tl.int64)
        ck = tl.arange(0, BLOCK_K)
        cols = tl.arange(0, BLOCK_N)
        cc = tl.arange(0, CHUNK)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(KH * KW):
            s_lo = tl.load(plan_ptr + k * (N + 1) + n0)
            s_hi = tl.load(plan_ptr + k * (N + 1) + n1)
            if s_hi > s_lo:
                ih = ih0 + (k // KW) * DH
                iw = iw0 + (k % KW) * DW
                a_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                a_row = ((bb * H + ih) * W + iw) * C
                if ONE_K:
                    a = tl.load(x_ptr + a_row[:, None] + ck[None, :], mask=a_ok[:, None] & (ck[None, :] < C),
                                other=0.0)
                    if IS_FP32:
                        a = _round_tf32(a)
                for s0 in range(s_lo, s_hi, CHUNK):
                    st = s0 + cc
                    s_ok = st < s_hi
                    oc = tl.load(oi_ptr + st, mask=s_ok, other=-1) - n0
                    p = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)
                    for c0 in range(0, C, BLOCK_K):
                        c_ok = (c0 + ck) < C
                        if not ONE_K:
                            a = tl.load(x_ptr + a_row[:, None] + (c0 + ck)[None, :],
                                        mask=a_ok[:, None] & c_ok[None, :], other=0.0)
                            if IS_FP32:
                                a = _round_tf32(a)
                        wt = tl.load(w_ptr + st[None, :].to(tl.int64) * C + (c0 + ck)[:, None],
                                     mask=s_ok[None, :] & c_ok[:, None], other=0.0)
                        if IS_FP32:
                            wt = _round_tf32(wt)
                        p = tl.dot(a, wt, p)
                    r = (oc[:, None] == cols[None, :])
                    if IS_FP32:
                        p_hi = _round_tf32(p)
                        p_lo = _round_tf32(p - p_hi)
                        rf = r.to(tl.float32)
                        acc = tl.dot(p_hi, rf, acc)
                        acc = tl.dot(p_lo, rf, acc)
                    else:
                        acc = tl.dot(p.to(x_ptr.dtype.element_ty), r.to(x_ptr.dtype.element_ty), acc)
        n_ok = (n0 + cols) < N
        if HAS_BIAS:
            bias = tl.load(b_ptr + n0 + cols, mask=n_ok, other=0.0).to(tl.float32)
            acc += bias[None, :]
        if RELU:
            acc = tl.maximum(acc, 0.0)
        y_off = (bb * sy_b + (t % Ho) * sy_h + jw * sy_w)[:, None] + ((n0 + cols) * sy_c)[None, :]
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _pow2(v: int, lo: int, hi: int) -> int:
    p = lo
    while p < v and p < hi:
        p *= 2
    return p


def default_config(C: int, N: int, S: int, K: int, dtype: torch.dtype) -> dict:
    """Heuristic tile choice (tuned in benchmarks/stripe_gpu.py)."""
    block_k = _pow2(C, 16, 64 if dtype == torch.float32 else 128)
    block_n = _pow2(N, 16, 64 if C <= 64 else 128)
    return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, CHUNK=16 if S <= 0.2 * K * N else 32,
                num_warps=4 if block_n <= 64 else 8, num_stages=2)


def forward(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
            relu, config: dict | None = None):
    """Launch the fused kernel; arguments as ``compress::stripe_conv2d`` (plan required). Returns y."""
    B, C, H, W = x.shape
    N = out_channels
    KH, KW = kernel_size
    Ho = (H + 2 * padding[0] - dilation[0] * (KH - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (KW - 1) - 1) // stride[1] + 1
    fmt = memory_format(x)
    y = torch.empty((B, N, Ho, Wo), device=x.device, dtype=x.dtype, memory_format=fmt)
    M = B * Ho * Wo
    if M == 0:
        return y
    xc = x.contiguous(memory_format=torch.channels_last)
    cfg = dict(config or default_config(C, N, weight.shape[0], KH * KW, x.dtype))
    BM, BN = cfg.pop("BLOCK_M"), cfg["BLOCK_N"]
    cfg["ONE_K"] = C <= cfg["BLOCK_K"]
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _stripe_fwd_kernel[grid](
        xc, weight.contiguous(), out_index, plan, bias if bias is not None else y, y,
        M, C, H, W, Ho, Wo, N, *y.stride(),
        SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1], KH=KH, KW=KW,
        HAS_BIAS=bias is not None, RELU=relu, IS_FP32=x.dtype == torch.float32, BLOCK_M=BM, **cfg)
    return y
