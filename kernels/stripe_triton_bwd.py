"""Triton backward of ``compress::stripe_conv2d`` that skips the pruned stripes (stride 1).

The forward's stripes prune rows of the per-offset weight (output channel o at offset k). Seen from the backward,
those rows are on the *reduction* side, so both gradients are plain implicit GEMMs over the kept stripes only,
with each stripe's output-gradient column gathered at its own shift:

    G~[p, s] = g[b, ih + ph - kh_s*dh, iw + pw - kw_s*dw, o_s]      (p = input pixel (b, ih, iw); 0 outside)
    grad_x[p, c]   = sum_s G~[p, s] * w[s, c]                        (reduction over the S kept stripes)
    grad_w[s, c]   = sum_p G~[p, s] * x[p, c]                        (reduction over the input pixels)

(for stride 1: input pixel (ih, iw) meets output pixel (ih + ph - kh*dh, iw + pw - kw*dw) through offset k.)
Their multiply-adds are the kept MACs exactly: keep * the dense backward's. The stripes of a reduction chunk may
belong to different offsets (the shift is per column), so the loop over S is flat and software-pipelined.
Both read the output gradient and the input channels_last; grad_x is written channels_last, grad_w as float32
partial sums per pixel slice (summed after, deterministic: no atomics).
float32 runs on TF32 tensor cores with round-to-nearest operands (as the forward).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None

if triton is not None:
    from kernels.stripe_triton import _round_tf32

    @triton.jit
    def _pixel_codes(offs, P, H, W, Ho, Wo, N: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                     DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BIG: tl.constexpr):
        # per flat channels_last input pixel: the g offset of the output pixel at the same (image, row, column)
        # (each stripe adds its own shift) and a validity code: bit kh set when row ih + PH - kh*DH is an output
        # row, bit 8 + kw when column iw + PW - kw*DW is an output column (no bit for pixels at or past P)
        iw = offs % W
        t = offs // W
        ih = t % H
        bb = t // H
        if BIG:
            base = ((bb * Ho + ih) * Wo + iw).to(tl.int64) * N
        else:
            base = ((bb * Ho + ih) * Wo + iw) * N
        code = tl.zeros_like(offs)
        for kh in tl.static_range(KH):
            oh = ih + (PH - kh * DH)
            code |= ((oh >= 0) & (oh < Ho)).to(tl.int32) << kh
        for kw in tl.static_range(KW):
            ow = iw + (PW - kw * DW)
            code |= ((ow >= 0) & (ow < Wo)).to(tl.int32) << (8 + kw)
        return base, tl.where(offs < P, code, 0)

    @triton.jit
    def _stripe_codes(oi_ptr, off_ptr, ss, S, Wo, N: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                      DH: tl.constexpr, DW: tl.constexpr):
        # per stripe: the shift of its column in g (its kernel offset's output-pixel shift, plus its channel) and
        # the code bits a pixel needs for it (bit 30, never set in a pixel code, for stripes at or past S)
        s_ok = ss < S
        o = tl.load(oi_ptr + ss, mask=s_ok, other=0).to(tl.int32)
        kh = tl.load(off_ptr + 2 * ss, mask=s_ok, other=0).to(tl.int32)
        kw = tl.load(off_ptr + 2 * ss + 1, mask=s_ok, other=0).to(tl.int32)
        col = ((PH - kh * DH) * Wo + (PW - kw * DW)) * N + o
        code = tl.where(s_ok, (1 << kh) | (1 << (8 + kw)), 1 << 30)
        return col, code, s_ok

    @triton.jit
    def _gather_g(g_ptr, base, pcode, col, scode):
        # G~[p, s]: one add and one test per element (the separable parts come from _pixel_codes/_stripe_codes)
        ok = (pcode[:, None] & scode[None, :]) == scode[None, :]
        return tl.load(g_ptr + (base[:, None] + col[None, :]), mask=ok, other=0.0)

    @triton.jit
    def _dgrad_kernel(
        g_ptr, w_ptr, oi_ptr, off_ptr, dx_ptr,
        P, S, H, W, Ho, Wo,
        C: tl.constexpr, N: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        KH: tl.constexpr, KW: tl.constexpr, BIG: tl.constexpr, IS_FP32: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # grad_x[p, c] for BLOCK_P input pixels x BLOCK_C input channels: sum over all kept stripes, BLOCK_S at a time
        offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        base, pcode = _pixel_codes(offs, P, H, W, Ho, Wo, N, PH, PW, DH, DW, KH, KW, BIG)
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cs < C
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        ss = tl.arange(0, BLOCK_S)
        col, scode, s_ok = _stripe_codes(oi_ptr, off_ptr, ss, S, Wo, N, PH, PW, DH, DW)
        a = _gather_g(g_ptr, base, pcode, col, scode)
        b = tl.load(w_ptr + ss[:, None] * C + cs[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
        for s0 in range(BLOCK_S, S + BLOCK_S, BLOCK_S):
            # the next chunk's gathered loads are issued before this chunk's product (register double buffer:
            # gathered 2-byte loads cannot go through cp.async, so Triton's pipeliner does not overlap them)
            ss = s0 + tl.arange(0, BLOCK_S)
            col, scode, s_ok = _stripe_codes(oi_ptr, off_ptr, ss, S, Wo, N, PH, PW, DH, DW)
            a_next = _gather_g(g_ptr, base, pcode, col, scode)
            b_next = tl.load(w_ptr + ss[:, None] * C + cs[None, :], mask=s_ok[:, None] & c_ok[None, :], other=0.0)
            if IS_FP32:
                a = _round_tf32(a)
                b = _round_tf32(b)
            acc = tl.dot(a, b, acc)
            a, b = a_next, b_next
        out = offs.to(tl.int64) * C
        tl.store(dx_ptr + out[:, None] + cs[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=(offs < P)[:, None] & c_ok[None, :])

    @triton.jit
    def _wgrad_kernel(
        g_ptr, x_ptr, oi_ptr, off_ptr, part_ptr,
        p_per, P, S, H, W, Ho, Wo,
        C: tl.constexpr, N: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        KH: tl.constexpr, KW: tl.constexpr, BIG: tl.constexpr, IS_FP32: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # part[slice, s, c] = sum over the slice's input pixels p of G~[p, s] * x[p, c], for BLOCK_S stripes x
        # BLOCK_C input channels
        pid = tl.program_id(0)
        ss = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        col, scode, s_ok = _stripe_codes(oi_ptr, off_ptr, ss, S, Wo, N, PH, PW, DH, DW)
        cs = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cs < C
        p_start = pid * p_per
        p_end = tl.minimum(p_start + p_per, P)
        acc = tl.zeros((BLOCK_S, BLOCK_C), dtype=tl.float32)
        offs = p_start + tl.arange(0, BLOCK_P)
        base, pcode = _pixel_codes(offs, p_end, H, W, Ho, Wo, N, PH, PW, DH, DW, KH, KW, BIG)
        a = _gather_g(g_ptr, base, pcode, col, scode)
        xb = tl.load(x_ptr + offs.to(tl.int64)[:, None] * C + cs[None, :], mask=(offs < p_end)[:, None] & c_ok[None, :],
                     other=0.0)
        for p0 in range(p_start + BLOCK_P, p_end + BLOCK_P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)  # the next block's loads first (as in _dgrad_kernel)
            base, pcode = _pixel_codes(offs, p_end, H, W, Ho, Wo, N, PH, PW, DH, DW, KH, KW, BIG)
            a_next = _gather_g(g_ptr, base, pcode, col, scode)
            x_next = tl.load(x_ptr + offs.to(tl.int64)[:, None] * C + cs[None, :],
                             mask=(offs < p_end)[:, None] & c_ok[None, :], other=0.0)
            if IS_FP32:
                a = _round_tf32(a)
                xb = _round_tf32(xb)
            acc = tl.dot(tl.trans(a), xb, acc)
            a, xb = a_next, x_next
        off = (pid * S + ss[:, None]).to(tl.int64) * C + cs[None, :]
        tl.store(part_ptr + off, acc, mask=s_ok[:, None] & c_ok[None, :])


def _pow2(v: int, lo: int, hi: int) -> int:
    p = lo
    while p < v and p < hi:
        p *= 2
    return p


def supports(x: torch.Tensor, stride) -> bool:
    """Whether these kernels run the layer: CUDA (or the Triton interpreter), a Triton dtype, stride 1."""
    return (triton is not None and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and tuple(stride) == (1, 1))


def grad_input(grad, weight, out_index, offset, x_shape, kernel_size, padding, dilation, cfg: dict | None = None):
    """grad_x (B, C, H, W) channels_last of a stride-1 stripe conv, from grad (B, N, Ho, Wo) and the kept stripes
    weight (S, C), out_index (S,), offset (S, 2)."""
    B, C, H, W = x_shape
    N, Ho, Wo = grad.shape[1:]
    S = weight.shape[0]
    cfg = dict(cfg or grad_input_config(C, S, grad.dtype))
    g = grad.contiguous(memory_format=torch.channels_last)
    dx = torch.empty(x_shape, device=grad.device, dtype=grad.dtype, memory_format=torch.channels_last)
    P = B * H * W
    if S == 0:
        return dx.zero_()
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    grid = (triton.cdiv(P, cfg["BLOCK_P"]), triton.cdiv(C, cfg["BLOCK_C"]))
    _dgrad_kernel[grid](g, weight.contiguous(), out_index, offset.contiguous(), dx, P, S, H, W, Ho, Wo, C, N,
                        PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1], KH=kernel_size[0],
                        KW=kernel_size[1], BIG=g.numel() >= 2**31, IS_FP32=grad.dtype == torch.float32, **cfg,
                        num_warps=nw, num_stages=ns)
    return dx


def grad_input_config(C: int, S: int, dtype: torch.dtype) -> dict:
    return dict(BLOCK_P=128, BLOCK_C=_pow2(C, 16, 128), BLOCK_S=32, num_warps=4, num_stages=3)


def grad_weight(grad, x, out_index, offset, kernel_size, padding, dilation, cfg: dict | None = None):
    """grad of the kept stripes (S, C), float32, of a stride-1 stripe conv."""
    B, C, H, W = x.shape
    N, Ho, Wo = grad.shape[1:]
    S = out_index.shape[0]
    cfg = dict(cfg or grad_weight_config(C, S, x.dtype))
    P = B * H * W
    if S == 0:
        return torch.zeros((0, C), device=x.device, dtype=torch.float32)
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    bp = cfg["BLOCK_P"]
    tiles = triton.cdiv(S, cfg["BLOCK_S"]) * triton.cdiv(C, cfg["BLOCK_C"])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2  # 2: interpreter
    slices = max(1, min(triton.cdiv(cfg.pop("waves", 4) * sms, tiles), triton.cdiv(P, bp)))
    p_per = triton.cdiv(triton.cdiv(P, slices), bp) * bp
    slices = triton.cdiv(P, p_per)
    part = torch.empty((slices, S, C), device=x.device, dtype=torch.float32)
    grid = (slices, triton.cdiv(S, cfg["BLOCK_S"]), triton.cdiv(C, cfg["BLOCK_C"]))
    _wgrad_kernel[grid](grad.contiguous(memory_format=torch.channels_last),
                        x.contiguous(memory_format=torch.channels_last), out_index, offset.contiguous(), part,
                        p_per, P, S, H, W, Ho, Wo, C, N, PH=padding[0], PW=padding[1], DH=dilation[0],
                        DW=dilation[1], KH=kernel_size[0], KW=kernel_size[1], BIG=grad.numel() >= 2**31,
                        IS_FP32=x.dtype == torch.float32, **cfg, num_warps=nw, num_stages=ns)
    return part.sum(0) if slices > 1 else part[0]


def grad_weight_config(C: int, S: int, dtype: torch.dtype) -> dict:
    return dict(BLOCK_P=64, BLOCK_S=_pow2(S, 16, 64), BLOCK_C=_pow2(C, 16, 64), num_warps=4, num_stages=3, waves=4)
