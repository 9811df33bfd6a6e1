"""Triton GPU kernels of ``compress::stripe_conv2d``: the forward, a fused implicit GEMM on tensor cores, and the
backward pieces for narrow layers (section "backward" below).

Route (b) of DESIGN.md. A program owns BLOCK_M output pixels x BLOCK_N output channels [n0, n0+BLOCK_N).
For each kernel offset k, the stripes of offset k whose output channel is in the tile are the contiguous
range ``[plan[k, n0], plan[k, n0+BLOCK_N])`` of the canonical order (see ``kernels.stripe`` for the plan).
They are taken CHUNK at a time (all of one offset, so they share one shifted input tile A_k):

    P[M, CHUNK]    = A_k[M, C] @ W[chunk, C]^T        (tensor cores, fp32 accumulate)
    acc[M, BLOCK_N] += P @ R[CHUNK, BLOCK_N]           (R one-hot: stripe -> its output channel column)

so per-stripe results never leave registers. With GATHER (route b', the default from 128 input channels) the
one-hot product is replaced by ``acc[:, o] += P[:, s(k, o) - s0]`` (``tl.gather``; s(k, o) = the stripe of offset
k and channel o, read from the plan), which costs no tensor-core work: on an H200 (bf16, channels_last, random
masks, keep 0.3/0.15) it ran 1.07-1.52x faster than the one-hot route on 128-512-channel layers, 0.89-1.08x at
64 and 0.71-0.74x at 16-32 channels (benchmarks/results/stripe_gather_h200.json). The DENSE route (route (a):
A_k @ the zero-filled dense weight of offset k, skipping the offsets a tile keeps no stripe of) reads that weight
from the caller where it is kept (``dense=``); with it and C >= 16 in 16-bit (C == 16 in float32) it runs all
offsets in one loop without the skip (NOSKIP), which Triton software-pipelines (see ``default_config``). With at most
``IM2COL_MAX_C`` input channels (a first layer on RGB) the IM2COL route (c) multiplies the dense weight, viewed as
(N, KH*KW*C), with the im2col rows, BLOCK_K columns k*C + c at a time (``_im2col_columns``/``_im2col_load``,
shared with the weight-gradient kernel below): per offset, 3 channels would fill 3 of a tensor-core step's 16
K-lanes. It also runs 17-64-channel (and in 16-bit types 5-8-channel) layers when the dense weight is kept
(less padding than a per-offset tile). With SWAP it accumulates the product transposed, output channels x pixels,
so that the pixel tile is the tensor-core instruction's wide side (see ``default_config``). On an H200 (bf16,
channels_last) it ran the 7x7 stride-2 ImageNet stem (batch 128) 2.0x (2.6-2.8x with the input padded to 4
channels, see IM2COL_PAD_C) and the CIFAR VGG16 first conv (batch 256) 4.4x faster than cuDNN's dense conv, which
pads 3 channels to 8 (benchmarks/results/stripe_stem_gpu_h200{,_pad4_final}.json). Epilogue: bias, optional ReLU,
store in the output's layout (NCHW or channels_last; the input is read channels_last, an NCHW input is
converted first).
float32 inputs use TF32 tensor cores with round-to-nearest operands, and P is split into two TF32 parts
for the one-hot reduction, so the result stays within ~1e-4 relative of float32.

Tried and dropped (H200, 2026-11-21): one flat loop of uniform (offset, stripe chunk, channel chunk) steps so
that Triton pipelines the loads across offsets (gather reduction). Keep 0.3 and 0.15 ran in the same time on
64-channel layers, so the kernel looked latency-bound, but the flat loop was no faster than the nested one
(0.47-0.87x cuDNN vs 0.48-0.86x; benchmarks/results/stripe_flat_reverted_h200.json). Loading every offset's
stripe range of the tile up front (two vector loads instead of two dependent scalar loads per offset) changed
nothing either (within 5% both ways; benchmarks/results/stripe_preload_reverted_h200.json). A CUDA tensor-core
kernel (mma.m16n8k16 per offset, cp.async double buffering, a per-warp scatter of P into an fp32 shared-memory
tile; commit b317148, reverted) was correct but 0.21-0.37x cuDNN, slower than this kernel everywhere
(benchmarks/results/stripe_cuda_mma_v{1,2}_h200.json): it waits on one 64-pixel step of loads at a time.
An input-stationary kernel (commit f509906, reverted): a program owns whole output rows, loads the input rows
they read (with the halo) once instead of once per offset, multiplies them by a chunk of stripes and picks each
output pixel's shifted value with tl.gather (lowered to warp shuffles) before the one-hot sum. Correct, but 2-6x
slower than this kernel on every narrow layer measured (H200, bf16; stripe_halo_reverted_h200.json): the gather
and the doubled pixel count of the halo product cost more than the loads it saves.
A CUDA "halo" kernel for stride-1 layers (commits 1b47f17..492aae2, reverted): per tile of whole output rows it
staged the input rows with their halo (cp.async, double-buffered, persistent blocks) and every stripe weight in
shared memory, computed each stripe once per staged position (Z = X W^T, ldmatrix + mma.sync, fp32 in shared
memory), then summed each output channel's stripes at their shifts (+ bias, ReLU, pool). Its multiply-adds are
the kept stripes' (times the halo rows), but it was 1.4-8x slower than the best existing mode on every layer of
the real-mask VGG16 and ResNet-56 and of random-mask ResNet-56 (H200, bf16, batch 256;
stripe_halo_v4_reverted_h200.json): Nsight Compute showed it instruction-bound on the per-output shifted sums
(about 60 instructions per output value even with one stripe), where this kernel's outputs come straight from
its accumulators; the first version (WMMA, one block per tile) was 2-10x slower (stripe_halo_v1_reverted_h200.json).
A dense CUDA conv for narrow 16-bit layers (session 16, a prototype never on main: input window with its halo
staged once per tile by cp.async, all offsets' weights in shared memory, A fragments by ldmatrix straight from the
window at each offset's shift, mma.m16n8k16 into register accumulators, offsets without weights skipped), aimed at
the compact VGG16's 40-channel 32x32 layer where cuDNN is slow: correct (9 float64 checks), 1.3-1.8x faster than
cuDNN there but 0.56-0.80x this kernel, and 0.13-0.94x it on the other narrow layers (conv_halo_v{1,2}_reverted_h200.json,
source conv_halo_reverted.cu.txt).
A dense conv whose input tiles come by TMA (session 17, a prototype never on main: one box [1, TH, TW, CB] of the
channels_last input per (offset, channel chunk), padding rows and columns and channels past C zero-filled by the
hardware, so no per-element index math; N split into two power-of-2 tiles; a flat pipelined loop over the offsets
a layer keeps): correct, but slower than this kernel's defaults on 10 of 12 narrow layers (VGG16's 40 -> 40 32x32
layer 0.0756 against 0.0609 ms; H200, bf16, stripe_tma_v{1,2}_dropped_h200.json, sources
stripe_tma_v{1,2}_dropped.py.txt). It won on the 64 -> 80 16x16 layer (0.0228 against 0.0342 ms), mostly from
reading its input tile once for all 80 channels, which route (c) with SWAP (``default_config``) now also does.
Route (a) with the output channels permuted (greedily, so that each 16/32-channel tile's channels share kernel
offsets and fewer (offset, tile) blocks are computed) was slower than without on the layers of the real-mask
VGG16/ResNet-18/ResNet-56 (a permuted channel store does not vectorise; stripe_perm_dense_reverted_h200.json).
Route (c) the same way (session 18, a standalone prototype: outputs grouped into 16/32-channel tiles that keep
51-67% of the offsets on VGG16's 40 -> 40 layer, each tile looping over only its offsets' im2col columns) was
0.2-0.6x the defaults on 11 real-mask VGG16/ResNet-56 layers: a column's offset read from the tile's list hides
the contiguity of its loads (no vector loads), and fewer columns per tile did not make up for the extra tiles
reading the input (within the prototype, 16-channel tiles at 51% of the offsets 0.079 ms against 0.076 for one
64-channel tile; stripe_tiledk_dropped_h200.json, script stripe_tiledk_dropped.py.txt).
The input's index math in 32 bits (x always has fewer than 2^31 elements here) left the outputs bitwise equal and
the time within noise on route (c) (median 1.00x over 41 layers, 0.90-1.02x) and the gather route (0.96-1.02x, fp32
slower); only the DENSE route gained, 0.97-1.15x (median 1.02x), too little and too mixed to keep a second index
path (session 18; stripe_x32_dropped_h200.json, script and patch stripe_x32_dropped.{py,diff}.txt).

The channel counts C and N are compile-time constants (one compile per layer shape): as runtime arguments
Triton could not prove the channels_last rows 16-byte aligned unless C and N were multiples of 16, and the
other widths of compact models (40, 104, 120, 200, 232, ...) ran with scalar loads and stores. On the layers of
the real-mask VGG16/ResNet-18/ResNet-56 (H200, bf16), the constants made those layers 1.1-10x faster (VGG16
232 -> 360 channels at 2x2: 0.231 -> 0.022 ms; stripe_perm_dense_reverted_h200.json "default_ms" against
stripe_models_gpu_h200_gpu_modes*.json "layers") and left the multiple-of-16 ones within 0.93-1.32x.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
    from triton.compiler import CompiledKernel
except ImportError:  # pragma: no cover - triton ships with CUDA torch builds
    triton = None
try:  # grid dependency control (programmatic dependent launch, Hopper and later) and the launch option for it
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_wait

    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:  # pragma: no cover - a Triton with one but not the other
        gdc_wait = None
except ImportError:  # pragma: no cover - a Triton without it
    gdc_wait = None

from kernels._utils import conv_out_size, conv_tf32, memory_format
from kernels.pool import max_pool2x2
from kernels.stripe import stripe_rows, stripe_to_dense


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``x``: CUDA, triton importable, float16/bfloat16, or float32 while convs
    may multiply in TF32 as the kernel does (`kernels._utils.conv_tf32`: PyTorch's default; a user who turns it off
    gets full float32 products from PyTorch's paths)."""
    if triton is None or not x.is_cuda:
        return False
    return x.dtype in (torch.float16, torch.bfloat16) or (x.dtype == torch.float32 and conv_tf32())


if triton is not None:

    @triton.jit
    def _round_tf32(v):
        # round-to-nearest to TF32 (10 mantissa bits) so that tensor-core truncation adds no bias
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x1000) & -8192  # -8192 == 0xFFFFE000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _load_a(x_ptr, a_row, a_ok, cks, C: tl.constexpr, IS_FP32: tl.constexpr):
        # A tile: input channels cks of the (channels_last) rows a_row, 0 where a row is out of range (a_ok
        # False) or a channel is >= C; TF32-rounded for float32
        a = tl.load(x_ptr + a_row[:, None] + cks[None, :], mask=a_ok[:, None] & (cks[None, :] < C), other=0.0)
        if IS_FP32:
            a = _round_tf32(a)
        return a

    @triton.jit
    def _offset_rows(k, ih0, iw0, bb, m_ok, C: tl.constexpr, H, W, DH: tl.constexpr, DW: tl.constexpr,
                     KW: tl.constexpr):
        # the (channels_last) input row of each output pixel shifted by kernel offset k, and whether it lies inside
        ih = ih0 + (k // KW) * DH
        iw = iw0 + (k % KW) * DW
        a_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        return ((bb * H + ih) * W + iw) * C, a_ok

    @triton.jit
    def _im2col_columns(js, C: tl.constexpr, W, DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr,
                        KW: tl.constexpr):
        # im2col column j = k*C + c (input channel c at kernel offset k): the offset's row and column shift (dh, dw),
        # the element's distance from its pixel's unshifted (channels_last) row, and whether the column exists
        kj = js // C
        dh = (kj // KW) * DH
        dw = (kj % KW) * DW
        return dh, dw, (dh * W + dw) * C + js % C, js < KH * KW * C

    @triton.jit
    def _im2col_load(x_ptr, row0, ih0, iw0, m_ok, dh, dw, shift, j_ok, H, W):
        # the im2col tile (pixels x columns): pixel m's unshifted row row0[m] + the column's shift, 0 where the
        # shifted position falls outside the input (padding), the pixel is out of range or the column does not exist
        ih = ih0[:, None] + dh[None, :]
        iw = iw0[:, None] + dw[None, :]
        ok = m_ok[:, None] & j_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        return tl.load(x_ptr + row0[:, None] + shift[None, :], mask=ok, other=0.0)

    @triton.jit
    def _dense_step(acc, x_ptr, w_ptr, a_row, a_ok, k, c0, n0, ck, cols, C: tl.constexpr, N: tl.constexpr,
                    KH: tl.constexpr, KW: tl.constexpr, IS_FP32: tl.constexpr):
        # route (a), one step: acc += A_k[:, c0:c0+BLOCK_K] @ W_k[c0:c0+BLOCK_K, tile] (W: zero-filled dense weight;
        # a_row, a_ok: _offset_rows of offset k)
        a = _load_a(x_ptr, a_row, a_ok, c0 + ck, C, IS_FP32)
        wt = tl.load(w_ptr + (n0 + cols)[None, :].to(tl.int64) * (KH * KW * C) + (k * C + c0 + ck)[:, None],
                     mask=((c0 + ck) < C)[:, None] & ((n0 + cols) < N)[None, :], other=0.0)
        if IS_FP32:
            wt = _round_tf32(wt)
        return tl.dot(a, wt, acc)

    @triton.jit
    def _dense_offset(acc, x_ptr, w_ptr, k, ih0, iw0, bb, m_ok, n0, ck, cols, C: tl.constexpr, H, W, N: tl.constexpr,
                      DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, IS_FP32: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        # route (a): acc += A_k @ W_k, the exact dense tile of kernel offset k
        a_row, a_ok = _offset_rows(k, ih0, iw0, bb, m_ok, C, H, W, DH, DW, KW)
        for c0 in range(0, C, BLOCK_K):
            acc = _dense_step(acc, x_ptr, w_ptr, a_row, a_ok, k, c0, n0, ck, cols, C, N, KH, KW, IS_FP32)
        return acc

    @triton.jit
    def _stripe_fwd_kernel(
        x_ptr, w_ptr, oi_ptr, plan_ptr, ko_ptr, b_ptr, y_ptr,
        M, C: tl.constexpr, H, W, Ho, Wo, N: tl.constexpr, S,
        sy_b, sy_c, sy_h, sy_w,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        HAS_BIAS: tl.constexpr, RELU: tl.constexpr, IS_FP32: tl.constexpr, OUT_CL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
        ONE_K: tl.constexpr, DENSE: tl.constexpr, GATHER: tl.constexpr, NOSKIP: tl.constexpr, IM2COL: tl.constexpr,
        POOL: tl.constexpr, SWAP: tl.constexpr = False, LISTED: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        # w_ptr: route (b) stripe weight (S, C); DENSE route (a): zero-filled dense weight, channels_last
        # (N, KH, KW, C) in memory, so both routes load weight tiles contiguous along C
        if PDL:  # launched with PDL (``pdl_launch``): wait for the previous kernel before any memory access
            gdc_wait()
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        n0 = pid_n * BLOCK_N
        n1 = tl.minimum(n0 + BLOCK_N, N)
        if POOL:  # rows 4q..4q+3 of the tile: the 2x2 window of pooled pixel pid_m * BLOCK_M / 4 + q
            lq = tl.arange(0, BLOCK_M)
            q = pid_m * (BLOCK_M // 4) + lq // 4
            win = lq % 4
            qt = q // (Wo // 2)
            offs_m = ((qt // (Ho // 2)) * Ho + (qt % (Ho // 2)) * 2 + win // 2) * Wo + (q % (Wo // 2)) * 2 + win % 2
            m_ok = q < M // 4
        else:
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
        if IM2COL:  # route (c): the dense weight (N, KH*KW*C) against the im2col rows, BLOCK_K columns at a time
            row0 = ((bb * H + ih0) * W + iw0) * C
            if SWAP:
                acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for j0 in range(0, KH * KW * C, BLOCK_K):
                js = j0 + ck
                dh, dw, shift, j_ok = _im2col_columns(js, C, W, DH, DW, KH, KW)
                a = _im2col_load(x_ptr, row0, ih0, iw0, m_ok, dh, dw, shift, j_ok, H, W)
                if SWAP:  # acc^T (channels x pixels) += W (channels x columns) @ im2col^T
                    wn = tl.load(w_ptr + (n0 + cols)[:, None].to(tl.int64) * (KH * KW * C) + js[None, :],
                                 mask=j_ok[None, :] & ((n0 + cols) < N)[:, None], other=0.0)
                    if IS_FP32:
                        a = _round_tf32(a)
                        wn = _round_tf32(wn)
                    acc_t = tl.dot(wn, tl.trans(a), acc_t)
                else:
                    wt = tl.load(w_ptr + (n0 + cols)[None, :].to(tl.int64) * (KH * KW * C) + js[:, None],
                                 mask=j_ok[:, None] & ((n0 + cols) < N)[None, :], other=0.0)
                    if IS_FP32:
                        a = _round_tf32(a)
                        wt = _round_tf32(wt)
                    acc = tl.dot(a, wt, acc)
            if SWAP:
                acc = tl.trans(acc_t)
        if NOSKIP:  # DENSE route over every offset, no data-dependent branch: Triton pipelines the loads
            for k in range(KH * KW):
                acc = _dense_offset(acc, x_ptr, w_ptr, k, ih0, iw0, bb, m_ok, n0, ck, cols, C, H, W, N, DH, DW, KH,
                                    KW, IS_FP32, BLOCK_K)
        if LISTED:  # DENSE route over the tile's kept offsets only (ko_ptr: ``tile_offsets``), in one flat loop
            # of (offset, channel chunk) steps with no data-dependent branch, which Triton software-pipelines
            ko_row = ko_ptr + pid_n * (KH * KW + 1)
            KC: tl.constexpr = (C + BLOCK_K - 1) // BLOCK_K
            for j in range(0, tl.load(ko_row) * KC):
                k = tl.load(ko_row + 1 + j // KC)
                a_row, a_ok = _offset_rows(k, ih0, iw0, bb, m_ok, C, H, W, DH, DW, KW)
                acc = _dense_step(acc, x_ptr, w_ptr, a_row, a_ok, k, (j % KC) * BLOCK_K, n0, ck, cols, C, N, KH, KW,
                                  IS_FP32)
        for k in range(0 if (NOSKIP or IM2COL or LISTED) else KH * KW):
            s_lo = tl.load(plan_ptr + k * (N + 1) + n0)
            s_hi = tl.load(plan_ptr + k * (N + 1) + n1)
            if s_hi > s_lo:
                if DENSE:  # skipped above when the tile keeps no stripe of this offset
                    acc = _dense_offset(acc, x_ptr, w_ptr, k, ih0, iw0, bb, m_ok, n0, ck, cols, C, H, W, N, DH, DW,
                                        KH, KW, IS_FP32, BLOCK_K)
                else:
                    a_row, a_ok = _offset_rows(k, ih0, iw0, bb, m_ok, C, H, W, DH, DW, KW)
                    if ONE_K:
                        a = _load_a(x_ptr, a_row, a_ok, ck, C, IS_FP32)
                    if GATHER:
                        # first stripe of (k, o) for each column o of the tile, and whether it exists
                        s_first = tl.load(plan_ptr + k * (N + 1) + n0 + cols, mask=(n0 + cols) < N, other=0)
                        s_has = tl.load(plan_ptr + k * (N + 1) + n0 + cols + 1, mask=(n0 + cols) < N,
                                        other=0) > s_first
                    for s0 in range(s_lo, s_hi, CHUNK):
                        st = s0 + cc
                        s_ok = st < s_hi
                        p = tl.zeros((BLOCK_M, CHUNK), dtype=tl.float32)
                        for c0 in range(0, C, BLOCK_K):
                            c_ok = (c0 + ck) < C
                            if not ONE_K:
                                a = _load_a(x_ptr, a_row, a_ok, c0 + ck, C, IS_FP32)
                            wt = tl.load(w_ptr + st[None, :].to(tl.int64) * C + (c0 + ck)[:, None],
                                         mask=s_ok[None, :] & c_ok[:, None], other=0.0)
                            if IS_FP32:
                                wt = _round_tf32(wt)
                            p = tl.dot(a, wt, p)
                        if GATHER:
                            # column o of the tile takes P's column (its stripe - s0) when that is in this chunk
                            loc = s_first - s0
                            hit = s_has & (loc >= 0) & (loc < CHUNK)
                            idx = tl.broadcast_to(tl.where(hit, loc, 0)[None, :], (BLOCK_M, BLOCK_N))
                            acc += tl.where(hit[None, :], tl.gather(p, idx, 1), 0.0)
                        else:
                            oc = tl.load(oi_ptr + st, mask=s_ok, other=-1) - n0
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
        if POOL:  # 2x2 max-pool, stride 2: each window is 4 consecutive rows of the tile (see offs_m)
            acc = tl.max(tl.reshape(acc, (BLOCK_M // 4, 4, BLOCK_N)), axis=1)
            offs_q = pid_m * (BLOCK_M // 4) + tl.arange(0, BLOCK_M // 4)  # pooled pixels, (b, ho // 2, wo // 2)
            q_ok = offs_q < M // 4
            if OUT_CL:
                y_off = (offs_q.to(tl.int64) * N)[:, None] + (n0 + cols)[None, :]
            else:
                qw = offs_q % (Wo // 2)
                qt = offs_q // (Wo // 2)
                y_off = ((qt // (Ho // 2)).to(tl.int64) * sy_b + (qt % (Ho // 2)) * sy_h + qw * sy_w)[:, None] \
                    + ((n0 + cols) * sy_c)[None, :]
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=q_ok[:, None] & n_ok[None, :])
        else:
            if OUT_CL:  # pixel rows of N channels: with N a compile-time constant the stores vectorise
                y_off = (offs_m.to(tl.int64) * N)[:, None] + (n0 + cols)[None, :]
            else:
                y_off = (bb * sy_b + (t % Ho) * sy_h + jw * sy_w)[:, None] + ((n0 + cols) * sy_c)[None, :]
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


IM2COL_MAX_C = 4  # route (c) up to this many input channels
# route (c) pads narrower inputs (RGB) of large kernels to this many channels in memory (config key PAD_C): a
# pixel's 4 channels are one aligned 8-byte (16-bit) or 16-byte (float32) vector, so the im2col tiles load as
# vectors through cp.async; 3 channels load as single elements, synchronously (PTX of the 7x7 stem config: 16
# cp.async of 8 bytes against 32 ld.global.b16 per step)
IM2COL_PAD_C = 4


def _pow2(v: int, lo: int, hi: int) -> int:
    p = lo
    while p < v and p < hi:
        p *= 2
    return p


LISTED_TILES = (128, 64, 32, 16)  # the LISTED route's output-channel tile widths
LISTED_MAX_KEEP = 0.5  # ... taken where a tile keeps at most this share of the kernel offsets (default_config)


SMALL_PIXELS = 16384  # output pixels up to which a wide layer takes the DENSE route with the weight kept


def _im2col_one_stage(N: int) -> dict:
    """Route (c) with 128-pixel tiles, 32 columns per step, 4 warps and no software pipelining (plain loads,
    cached in L1): the config of 5-8-channel 16-bit layers and of larger 33-40-channel grids (default_config)."""
    return dict(BLOCK_M=128, BLOCK_N=_pow2(N, 16, 64), BLOCK_K=32, CHUNK=16, num_warps=4, num_stages=1, IM2COL=True)


def _listed_config(C: int, N: int, dtype: torch.dtype, keep: dict[int, float]) -> dict | None:
    """The LISTED route's config for a layer whose tiles skip offsets (``keep``: ``tile_keep``), or None. The widest
    tile (up to N) whose kept share of offsets is within 1.2x of the 16-channel tiles' and at most LISTED_MAX_KEEP:
    tiles as wide as the mask's groups skip the most work per pixel tile loaded. On an H200 (channels_last, CUDA
    graphs, masks shared by 16-128 filters, benchmarks/results/stripe_blocks_gpu_h200_{narrow,wide}_first.json) the LISTED route with
    64-pixel tiles (128 for 16-bit tiles of up to 32 channels), 4 warps and 3 stages was within 13% of the best of
    5 tilings and 1.03-3.25x faster than the layer's default route on the 62 (layer, dtype) cases keeping at most
    0.4 of the offsets; at 0.42-0.56 0.91-1.55x, at 0.78 0.98-1.04x. A sweep of 60-72 tilings on 8 bf16 layers
    (stripe_listed_sweep_h200.json) then moved 16-bit layers to 64 input channels per step (128 before) and 5
    stages from 256 input channels: within 1.0-1.22x of each layer's best, against 1.02-1.74x for the first
    choice. float32 keeps 3 stages (5 would not fit its tiles in shared memory). With these tiles, the default
    was within 1.0-1.34x of the best of 7 configs on all 80 (layer, group, keep, dtype) cases, 1.0x on 54
    (stripe_blocks_gpu_h200_{narrow,wide}.json)."""
    cap = _pow2(N, 16, 128)
    least = min(keep.values())
    for bn in LISTED_TILES:
        if bn <= cap and keep[bn] <= min(LISTED_MAX_KEEP, 1.2 * least):
            half = dtype != torch.float32
            return dict(BLOCK_M=128 if half and bn <= 32 else 64, BLOCK_N=bn, BLOCK_K=_pow2(C, 16, 64), CHUNK=16,
                        num_warps=4, num_stages=5 if half and C >= 256 else 3, DENSE=True, LISTED=True)
    return None


def default_config(C: int, N: int, S: int, K: int, dtype: torch.dtype, dense_given: bool = False,
                   pixels: int | None = None, tile_keep: dict[int, float] | None = None) -> dict:
    """Heuristic tile choice (tuned in benchmarks/stripe_gpu.py). ``dense_given``: the caller passes the dense
    weight (kept from before), so the DENSE route costs no per-call weight build. ``pixels``: the output pixels
    B*Ho*Wo (None: unknown, taken as many). With it, the DENSE route wins up to 64 input channels (and, over every
    offset, on most wider 16-bit layers: see ``_wide_tiles``): on an H200 (bf16, channels_last, CUDA graphs,
    ResNet-56-like layers at batch 256) it ran 1.4-2.0x faster than the one-hot route at 24-64 channels and within
    5% of the best of 20 tilings (benchmarks/results/stripe_tiles_narrow_h200.json); building the weight per call
    costs about as much as such a layer, so without it the DENSE route stays for C <= 16 and mostly-kept layers.
    ``tile_keep`` (``tile_keep(plan, N)``, from 16 input channels with the weight kept): where tiles of output
    channels keep few kernel offsets (masks shared by groups of filters), the LISTED route (``_listed_config``)."""
    if dense_given and tile_keep is not None and C >= 16:
        listed = _listed_config(C, N, dtype, tile_keep)
        if listed is not None:
            return listed
    if C <= IM2COL_MAX_C:  # route (c), a first layer (RGB input): the best of a sweep on an H200, bf16 channels_last
        # (benchmarks/stripe_stem_gpu.py -> stripe_stem_gpu_h200.json): 3x3 stems (27 columns) 128-pixel tiles;
        # unpadded 7x7 stems (147 columns) 64-pixel tiles, 32 columns per step (1.6x faster than 64 columns).
        # With more than 64 columns (the 7x7 stem: 147) the input is padded to IM2COL_PAD_C channels (PAD_C): on
        # an H200 (bf16) the ImageNet stem at batch 128 took 0.30-0.35 ms against 0.45-0.49 ms for the best
        # unpadded tiling in the same run (stripe_stem_gpu_h200_pad4_final.json; padded, 128-pixel tiles and 3
        # stages were the best of 12 tilings, stripe_stem_gpu_h200_pad4.json); the 3x3 first conv (27 columns, one
        # step; 36 padded, two) took 0.032 ms padded against 0.016 (same files), so it stays unpadded. 5x5 (75
        # columns) was not measured.
        small = K * C <= 32
        if K * C > 64 and C < IM2COL_PAD_C:
            return dict(BLOCK_M=128, BLOCK_N=_pow2(N, 16, 64), BLOCK_K=32, CHUNK=16, num_warps=4, num_stages=3,
                        IM2COL=True, PAD_C=IM2COL_PAD_C)
        return dict(BLOCK_M=128 if small else 64, BLOCK_N=_pow2(N, 16, 64), BLOCK_K=32, CHUNK=16, num_warps=4,
                    num_stages=3 if small else 2, IM2COL=True)
    if dense_given and 4 < C <= 8 and dtype != torch.float32:
        # 5-8 channels in 16-bit types: route (c) too, 32 columns per step, 4 warps, no software pipelining
        # (L1-cached plain loads): 8 -> 16 channels at 32x32 (batch 256, H200) 0.0125 ms against 0.0205 for route
        # (a), whose 16-channel steps are half padding, and 0.0186 pipelined (stripe_narrow_stages_h200.json)
        return _im2col_one_stage(N)
    if dense_given and 16 < C <= 64:
        # route (c) also for 17-64 channels: it pads the channels less than a per-offset tile does (40 channels:
        # 384 of 360 columns against 9 x 64). On an H200 (channels_last, benchmarks/stripe_stem_gpu.py --narrow) it
        # ran in bf16 1.26-1.30x faster than route (a) at 32-40 channels and 1.03-1.25x at 64
        # (stripe_narrow_im2col_gpu_h200.json), in float32 (TF32) 1.23-1.64x faster than the route (a) default
        # with 128-pixel tiles, 32 columns per step and 8 warps, within 5% of the best of 12 tilings but the
        # 64-channel 8x8 layer's (0.0190 against 0.0169 ms; stripe_narrow_im2col_fp32_gpu_h200.json).
        # 16 channels stay on route (a) (bf16 0.0182 against 0.0218 ms, fp32 0.0341 against 0.0398)
        # In 16-bit types up to 40 channels on mid-sized grids (16384-65536 output pixels: 1-4 waves of 128-pixel
        # tiles on 132 SMs), without software pipelining (num_stages 1: plain loads, cached in L1, and a third of
        # the shared memory per program) and 4 warps: 1.38x and 1.35x faster on 24 -> 32 and 40 -> 64 channels at
        # 16x16 (batch 256), 0.98x on 32 -> 24 there, than the 3-stage config (H200, bf16, CUDA graphs,
        # benchmarks/stripe_narrow_stages_gpu.py -> stripe_narrow_stages_h200.json). Outside that range the
        # pipeline paid: 0.0071 against 0.0046 ms on ResNet-56's stride-2 32 -> 48 layer (16384 pixels) and 0.0645
        # against 0.0606 ms on VGG16's pooled 40 -> 40 32x32 layer (stripe_models_gpu_h200_gemm.json against
        # _session10.json); 1 stage was 1.1-1.5x slower from 48 channels.
        if dtype == torch.float32:
            cfg = dict(BLOCK_M=128, BLOCK_N=_pow2(N, 16, 64), BLOCK_K=32, CHUNK=16, num_warps=8, num_stages=3,
                       IM2COL=True)
            if C <= 48 or N > 64:
                # SWAP (below) with 4 warps and one channel tile up to 128 output channels: 1.08-1.22x faster on
                # 24-40-channel layers at 16x16-32x32, 1.01-1.02x at 40 -> 64 and 48, 1.24x on 64 -> 80 16x16;
                # 0.93-0.98x on 64 -> 64, which keeps the plain product (H200, TF32, stripe_swap_fp32_h200.json)
                cfg.update(SWAP=True, num_warps=4, BLOCK_N=_pow2(N, 16, 128))
            return cfg
        one_stage = C <= 40 and pixels is not None and SMALL_PIXELS < pixels <= 4 * SMALL_PIXELS
        if 32 < C <= 40 and pixels is not None and pixels > 4 * SMALL_PIXELS:
            # larger grids of 33-40 channels: 1 stage with 32 columns per step; VGG16's 40 -> 40 32x32 layer
            # (batch 256) took 0.0567 ms against 0.0636 for the 3-stage default (stripe_narrow_stages_h200.json),
            # with its pool in the model 0.0583 ms against 0.0606-0.0607 in earlier runs
            # (stripe_models_gpu_h200_vgg_k32.json against _session11_final.json and _session10.json); with SWAP
            # (see there) 0.0555 against 0.0609 ms (stripe_swap_h200.json)
            return dict(_im2col_one_stage(N), SWAP=True)
        cfg = dict(BLOCK_M=128, BLOCK_N=_pow2(N, 16, 64), BLOCK_K=32 if C <= 32 else 64, CHUNK=16,
                   num_warps=4 if one_stage else (8 if C <= 32 else 4), num_stages=1 if one_stage else 3, IM2COL=True)
        if C > 32 and not one_stage:
            # 33-64 channels, 3 stages: SWAP (the product transposed, output channels x pixels, so that the pixel
            # tile is the tensor-core instruction's wide side: wgmma m64n128 instead of m64n64 plus ldmatrix) ran
            # 1.00-1.11x faster on six such layers, and up to 128 output channels one channel tile (the im2col
            # tile read once, not once per 64 channels) 1.34x on the compact VGG16's 64 -> 80 16x16 layer with its
            # pool, 0.0247 against 0.0332 ms (H200, bf16, CUDA graphs; stripe_swap_h200.json). Where the one-stage
            # configs or 17-32 channels took it, SWAP was 0.90-0.99x (same file), so they keep the plain product.
            cfg.update(SWAP=True, BLOCK_N=_pow2(N, 16, 128))
        return cfg
    sparse = S <= 0.2 * K * N
    if (dense_given and C > 64 and dtype != torch.float32 and pixels is not None and pixels <= SMALL_PIXELS
            and not (N >= 512 and sparse)):
        # wide layers on small maps (a CIFAR VGG16's 8x8, 4x4 and 2x2 layers at batch 256): few output pixels make
        # a small grid, and every route runs a long serial chain per tile. The DENSE route over every offset
        # (NOSKIP, software-pipelined) with the tile sizes below ran 1.25-2.4x faster than the sparse routes' default
        # on the real-mask VGG16's nine such layers (bf16, H200, CUDA graphs; stripe_small_gpu_h200_noskip.json
        # against the earlier default in stripe_small_gpu_h200.json, another run), at keep 0.14-0.21: the serial
        # chain, not the multiply-adds, sets the time there. Not for sparse layers of 512+ output channels: the gather
        # route with 256-channel tiles ran 1.62-1.64x faster than this at keep 0.15 on 512x4x4 (batch 1024) and
        # 512x7x7 (batch 128) (stripe_gather_tiles2_h200.json; at keep 0.3 this route stayed the best)
        # From 4097 pixels: route (c) with the wide layers' tiles (``_wide_tiles``); on the compact VGG16's 8x8
        # layers 80 -> 128, 128 -> 120 and 120 -> 104 (pooled) 1.45x, 1.10x and 1.07x faster than this route
        # (stripe_im2col_wide{,2}_h200.json), on 512x4x4 (batch 1024) 1.12x
        if pixels > 4096:
            return _wide_tiles(C, N, dtype)
        bm = 128 if pixels > 4096 else 64
        bn = 128 if pixels > 4096 else (32 if pixels <= 1024 and N <= 256 else 64)
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=_pow2(C, 16, 128), CHUNK=16, num_warps=8 if bm * bn > 8192 else 4,
                    num_stages=3, DENSE=True, NOSKIP=True)
    block_k = _pow2(C, 16, 64 if dtype == torch.float32 else 128)
    block_n = _pow2(N, 16, 64 if C <= 64 else 128)
    # wide 16-bit layers with the weight kept: a dense route over every offset (tiles in _wide_tiles: route (c)
    # since session 17, the DENSE route with NOSKIP before) unless the layer is sparse and has 512+ output
    # channels. With random masks nearly every (offset, tile) block holds a stripe, so the skip saves nothing, and
    # the pipelined dense loop beat the gather route on an H200 (bf16 channels_last, batch 1024 / 128): 128 channels at 16x16 and 28x28 1.60x and 1.81x at keep 0.3, 1.09x and
    # 1.34x at keep 0.15 (stripe_gpu_h200_wide{128,256}_noskip.json, "tuned_ms"); with 256-channel tiles at 256
    # channels 1.27x and 1.07x at keep 0.15, at 512 channels 1.38x and 1.41x at keep 0.3 (stripe_noskip_tiles_h200.json
    # against the gather times of stripe_gpu_h200_wide{256,512}_session15.json), while on sparse 512-channel layers
    # the gather route stayed 1.08-1.13x faster
    wide_dense = dense_given and C > 64 and dtype != torch.float32 and not (sparse and N >= 512)
    dense = (C <= 16 or (dense_given and C <= 64) or S > 0.4 * K * N or wide_dense
             or (dtype == torch.float32 and not sparse and C < 256))
    if C >= 128 and not dense:  # gather reduction
        return dict(_gather_tiles(C, N, sparse, dtype), BLOCK_K=block_k, DENSE=False, GATHER=True)
    # with the weight kept, C >= 16 and 16-bit data, the DENSE route runs every offset without the per-offset skip
    # (NOSKIP), a loop Triton software-pipelines (3 stages): in bf16 1.1-1.4x faster on 16-80-channel layers at keep
    # 0.1-0.5 (H200, stripe_tiles_noskip_h200.json) and 1.2-1.3x on 64x32x32 / 64x56x56 (stripe_gpu_h200_noskip.json);
    # in fp32 it was 0.88x at 64x56x56 (same file) but 1.30x at 16x32x32 (0.0341 against 0.0442 ms,
    # stripe_narrow_im2col_fp32_gpu_h200.json) and 1.06-1.23x on 128- and 256-channel layers that take the DENSE
    # route (stripe_gpu_h200_wide{128,256}_noskip.json), so fp32 at 17-64 channels, narrower inputs and layers
    # keeping under 3% of their stripes keep the skip
    noskip = (dense and dense_given and C >= 16 and S >= 0.03 * K * N
              and (dtype != torch.float32 or C == 16 or C > 64))
    if noskip and C > 64:
        return _wide_tiles(C, N, dtype)
    return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, CHUNK=16 if sparse else 32,
                num_warps=4 if block_n <= 64 else 8, num_stages=3 if noskip else 2, DENSE=dense, NOSKIP=noskip)


def _wide_tiles(C: int, N: int, dtype: torch.dtype) -> dict:
    """A dense route over every offset from 65 input channels (the dense weight kept): route (c), but for float32
    from 256 channels (mostly-kept layers there), the DENSE route with NOSKIP.

    - 16-bit: route (c), 64 im2col columns per step, 128 pixels x 256 output channels where 256-channel tiles pad N
      no more than 128-channel ones (256, 512, 176, 200: the im2col tile then is read once for them), else up to
      128 channels with SWAP (the product transposed, see ``default_config``); 8 warps, 3 stages. On an H200 (bf16,
      channels_last, CUDA graphs, keep 0.3 and 0.15; benchmarks/results/stripe_im2col_wide{,2}_h200.json, script
      stripe_im2col_wide.py.txt) it ran 1.07-2.3x faster than the DENSE route with NOSKIP and the same tiles (the
      default before session 17) on 13 layers of 72-512 channels: 1.3x on the issue's 128- and 256-channel
      shapes, 1.1x at 512, 1.4-2.3x on channel counts that are not multiples of 64 (72, 80, 88, 104, 144, 176, 352),
      where the dense route's per-offset steps of 64 channels were part padding. Within 22% of the best tiling
      measured on each (16% on the issue's shapes; in256x14x14 and 352x14x14 ran best with 128-channel SWAP
      tiles, 120x8x8 at batch 1024 with 256-pixel ones).
    - fp32 (TF32): 256 pixels x up to 128 channels, 32 columns per step, 8 warps; route (c) with 3 stages at
      65-255 channels: 1.12-1.47x faster than the DENSE route with NOSKIP and the same tiles (4 stages, the
      default before) on five 80-176-channel layers (stripe_im2col_wide_fp32_h200.json). From 256 channels (layers
      keeping over 0.4 of their stripes; sparser ones take the gather route) that DENSE route stays: route (c) was
      not measured against it there. Those tiles were the best of 10 for the DENSE route
      (stripe_noskip_tiles_h200.json)."""
    if dtype == torch.float32:
        route = dict(IM2COL=True, num_stages=3) if C < 256 else dict(DENSE=True, NOSKIP=True, num_stages=4)
        return dict(BLOCK_M=256, BLOCK_N=_pow2(N, 16, 128), BLOCK_K=32, CHUNK=16, num_warps=8, **route)
    wide = N > 128 and -(-N // 256) * 256 <= -(-N // 128) * 128  # 256-channel tiles pad no more than 128-channel
    return dict(BLOCK_M=128, BLOCK_N=256 if wide else _pow2(N, 16, 128), BLOCK_K=64, CHUNK=16, num_warps=8,
                num_stages=3, IM2COL=True, SWAP=not wide)


def _gather_tiles(C: int, N: int, sparse: bool, dtype: torch.dtype) -> dict:
    """Tiles of the gather route (``sparse``: at most 0.2 of the stripes kept). From a sweep on an H200 (random
    masks at keep 0.3 and 0.15, CIFAR VGG shapes at batch 1024 and ImageNet ones at batch 128, 128-512 channels,
    bf16 and fp32 channels_last, CUDA graphs; benchmarks/results/stripe_gather_tiles{,2}_h200.json, scripts
    stripe_gather_tiles{,2}.py.txt):
    - 512 channels, sparse, or fp32: 256 output channels per program (each offset's shifted input tile then serves
      twice the channels), 64-stripe chunks: in bf16 at keep 0.15 1.62-1.64x faster than the dense route these
      layers took before (small maps, see default_config); in fp32 1.19-1.20x faster than 128-channel tiles at keep
      0.15 and 1.50x faster than the dense route at keep 0.3;
    - 256+ channels, not sparse: 128 pixels x 128 channels, 64-stripe chunks, 8 warps (bf16: the best, or within
      1%; fp32: the best in the per-layer runs of sessions 15 and 16, 1.09-1.15x faster than the 64-pixel, 4-warp
      tiles first chosen, stripe_gpu_h200_wide_session16.json "tuned_ms");
    - fp32 256 channels, sparse: 128 pixels, 32-stripe chunks, 8 warps (the best on one shape, 8% off on the other);
    - otherwise (128-channel layers, and sparse 256-channel 16-bit ones): 64 pixels x up to 128 channels,
      32-stripe chunks, 4 warps, 2 stages: 1.05-1.23x faster than 64-stripe chunks at keep 0.3 on 128 channels,
      1.07-1.11x faster than the 128-pixel tiles at keep 0.15 on 256 channels."""
    fp32 = dtype == torch.float32
    if N >= 512 and (sparse or fp32):
        bm, bn, chunk, warps, stages = 128, 256, 64, 8, 3
    elif C >= 256 and not sparse:
        bm, bn, chunk, warps, stages = 128, 128, 64, 8, 3
    elif C >= 256 and fp32:
        bm, bn, chunk, warps, stages = 128, 128, 32, 8, 3
    else:
        bm, bn, chunk, warps, stages = 64, 128, 32, 4, 2
    return dict(BLOCK_M=bm, BLOCK_N=_pow2(N, 16, bn), CHUNK=chunk, num_warps=warps, num_stages=stages)


def _kept_blocks(plan: torch.Tensor, N: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool (K, tiles): whether each tile of ``block_n`` output channels keeps a stripe of each kernel offset, the
    tiles' widths (tiles,): block_n, the last one N mod block_n where that is not 0)."""
    n0 = torch.arange(0, N, block_n, device=plan.device)
    n1 = (n0 + block_n).clamp(max=N)
    return plan[:, n1] > plan[:, n0], n1 - n0


def tile_offsets(plan: torch.Tensor, N: int, block_n: int) -> torch.Tensor:
    """int32 (tiles, K + 1): per tile of ``block_n`` output channels, the number of kernel offsets it keeps a stripe
    of, then those offsets in increasing order, then the others (the LISTED route loops over the first ones). From
    the plan (K, N + 1), on its device, without a host read."""
    kept, _ = _kept_blocks(plan, N, block_n)
    order = torch.argsort((~kept).to(torch.int8), dim=0, stable=True)
    return torch.cat([kept.sum(0, keepdim=True), order]).t().contiguous().to(torch.int32)


def tile_keep(plan: torch.Tensor, N: int) -> dict[int, float]:
    """{block_n: share of the (kernel offset, output channel) pairs in (offset, tile of block_n channels) blocks that
    keep a stripe} for each width in LISTED_TILES: the work of a route that computes each tile's kept offsets only,
    against all offsets.
    With random masks nearly 1; with masks shared by groups of G filters (``prune.stripe_group``), the kept share
    of stripes for tiles up to G wide. One host read (call it when the plan is built, not per call)."""
    work = []
    for bn in LISTED_TILES:
        kept, width = _kept_blocks(plan, N, bn)
        work.append((kept.float() * width).sum() / (plan.shape[0] * max(N, 1)))
    return dict(zip(LISTED_TILES, torch.stack(work).tolist()))


def out_pixels(x: torch.Tensor, kernel_size, stride, padding, dilation) -> int:
    """The conv's output pixels B*Ho*Wo for input x (pairs of ints for the conv's parameters)."""
    return x.shape[0] * math.prod(conv_out_size(*a) for a in zip(x.shape[2:], kernel_size, stride, padding, dilation))


def reads_dense(cfg: dict) -> bool:
    """Whether a config's route reads the zero-filled dense weight (route (a), DENSE, or route (c), IM2COL)."""
    return cfg.get("DENSE", False) or cfg.get("IM2COL", False)


def forward(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
            relu, config: dict | None = None, dense=None, pool: bool = False, pool_ceil: bool = False):
    """Launch the fused kernel; arguments as ``compress::stripe_conv2d`` (plan required; ``dense``, the channels_last
    zero-filled dense weight, is built here when the DENSE route needs it and none is given; ``pool``,
    ``pool_ceil``: a 2x2 stride-2 max-pool of the result, see ``Launch``). Returns y."""
    return prepare(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
                   relu, config, dense, pool, pool_ceil)(x)


def prepare(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
            relu, config: dict | None = None, dense=None, pool: bool = False, pool_ceil: bool = False,
            tile_keep: dict[int, float] | None = None) -> Launch:
    """The forward's ``Launch`` for inputs like ``x`` (arguments as ``forward``; ``tile_keep`` as ``default_config``):
    route, tiles and weight operand chosen here, once."""
    C, N, KH, KW = x.shape[1], out_channels, *kernel_size
    cfg = dict(config or default_config(C, N, weight.shape[0], KH * KW, x.dtype, dense_given=dense is not None,
                                        pixels=out_pixels(x, kernel_size, stride, padding, dilation),
                                        tile_keep=tile_keep))
    if not reads_dense(cfg):
        wop = weight.contiguous()
    elif dense is not None:  # the zero-filled dense weight, channels_last: (N, KH, KW, C) in memory, exact
        wop = dense
    else:
        wop = stripe_to_dense(weight, out_index, offset, N, kernel_size, memory_format=torch.channels_last)
    return Launch(x, wop, out_index, plan, bias, N, weight.shape[0], kernel_size, stride, padding, dilation, relu,
                  cfg, pool, pool_ceil)


def pool_fusable(Ho: int, Wo: int) -> bool:
    """Whether the kernel's epilogue max-pools (2x2, stride 2) an Ho x Wo output: with even sizes (where both
    ceil modes agree) a tile takes the 4 pixels of each of BLOCK_M / 4 windows as consecutive rows and reduces
    them in registers. (Whole row pairs per tile, reduced through a 5-D reshape, were slower on an H200: the
    compact VGG16's 40-channel 32x32 layer with its pool took 0.0711 ms against 0.0617 ms this way, 0.0588 ms
    unpooled; stripe_models_gpu_h200_pool.json, stripe_models_gpu_h200_pool_windows.json.)"""
    return Ho % 2 == 0 and Wo % 2 == 0


PDL = True  # whether forward launches use programmatic dependent launch where it exists (``pdl_launch``)


def pdl_launch(x: torch.Tensor) -> bool:
    """Whether the forward kernel for ``x`` is launched with programmatic dependent launch (PDL): on Hopper and
    later GPUs (compute capability >= 9) with a Triton that has grid dependency control, while ``PDL`` is set.

    Such a launch lets the GPU start the kernel before the previous kernel on the stream has completed (here: once
    its programs have all exited, as this kernel signals nothing earlier); every program first waits for that
    kernel (``gdc_wait``), so no memory is touched early. On an H200 (bf16, channels_last; compact CIFAR ResNet-56 /
    VGG16 with real and random masks at batch 256, ResNet-18 at 128; benchmarks/results/stripe_pdl_ab_h200_run{2,3}.json)
    eager forwards ran 2-15% faster with it and CUDA-graph replays within 1.3% either way; outputs bitwise equal.
    Signalling the next kernel at each program's start (``gdc_launch_dependents``: its programs then queue during
    this kernel's last wave) gained 0.4-2.7% in graphs on ResNet-56 but lost 5-6% on the real-mask VGG16 in all
    three runs (run1-3), so it is not done."""
    return (PDL and gdc_wait is not None and x.is_cuda
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def input_signature(x: torch.Tensor) -> tuple:
    """What a ``Launch`` is specific to: x's shape, dtype, device, strides and 16-byte alignment (Triton
    specialises the kernel on pointer alignment)."""
    return tuple(x.shape), x.dtype, x.device, x.stride(), x.data_ptr() % 16 == 0


class Launch:
    """One layer's forward kernel launch for inputs with ``input_signature(x)``: the grid, the output's shape and
    layout and every kernel argument but the input and the output are fixed here; ``launch(x)`` allocates y and
    launches.

    The first call goes through Triton's JIT, which compiles or finds the kernel; later calls launch that compiled
    kernel directly with the same arguments, skipping the JIT's per-call binding, specialisation and cache lookup
    (much of an eager call's host time; ``StripeConv2d`` keeps one ``Launch`` per input for eager inference).
    Under ``TRITON_INTERPRET=1`` every call goes through the interpreter.

    ``pool``: the output is ``F.max_pool2d(y, 2, ceil_mode=pool_ceil)`` (after the bias and the ReLU), computed in
    the kernel's epilogue where ``pool_fusable`` (even sizes; the conv's full-size output is then never written),
    else by PyTorch after it.
    """

    def __init__(self, x, wop, out_index, plan, bias, N, S, kernel_size, stride, padding, dilation, relu, cfg,
                 pool=False, pool_ceil=False):
        B, C, H, W = x.shape
        KH, KW = kernel_size
        # PAD_C (route (c), see IM2COL_PAD_C): x is copied into a zero-padded channels_last buffer of PAD_C channels
        # per call (_run), the weight padded once here
        cfg = dict(cfg)
        self._pad_c = cfg.pop("PAD_C", 0)
        if self._pad_c and not (cfg.get("IM2COL", False) and C < self._pad_c):
            raise ValueError(f"stripe_triton.Launch: PAD_C={self._pad_c} needs the IM2COL route and fewer input "
                             f"channels, got {C} channels and config {cfg}")
        if self._pad_c:
            padded = wop.new_zeros(wop.shape[0], KH, KW, self._pad_c)
            padded[..., :C] = wop.permute(0, 2, 3, 1)
            wop = padded.permute(0, 3, 1, 2)
        Ho = conv_out_size(H, KH, stride[0], padding[0], dilation[0])
        Wo = conv_out_size(W, KW, stride[1], padding[1], dilation[1])
        self.signature = input_signature(x)
        fmt = memory_format(x)
        self._x_cl = x.is_contiguous(memory_format=torch.channels_last)
        self.pool_fused = bool(pool) and pool_fusable(Ho, Wo)
        self._pool_after = bool(pool) and not self.pool_fused
        self._pool_ceil = bool(pool_ceil)
        self._y_shape = (B, N, Ho // 2, Wo // 2) if self.pool_fused else (B, N, Ho, Wo)
        self._M = M = B * Ho * Wo
        cfg["ONE_K"] = C <= cfg["BLOCK_K"]
        cfg.setdefault("DENSE", False)
        cfg.setdefault("GATHER", False)
        cfg.setdefault("NOSKIP", False)
        cfg.setdefault("IM2COL", False)
        cfg.setdefault("SWAP", False)
        cfg.setdefault("LISTED", False)
        if cfg["LISTED"] and not cfg["DENSE"]:
            raise ValueError(f"stripe_triton.Launch: LISTED runs the DENSE route; got config {cfg}")
        self.config = dict(cfg)  # the route and tiles this launch runs (PAD_C aside)
        self.pdl = pdl_launch(x)
        self._grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]), 1)  # 3-D for the compiled kernel
        # y in x's layout; new_empty_strided (dtype and device from x) costs the host the least per call
        self._y_strides = y_strides = torch.empty(self._y_shape, device="meta", memory_format=fmt).stride()
        named = dict(
            SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1], KH=KH, KW=KW,
            HAS_BIAS=bias is not None, RELU=relu, IS_FP32=x.dtype == torch.float32,
            OUT_CL=fmt == torch.channels_last, POOL=self.pool_fused, PDL=self.pdl, **cfg)
        # the LISTED route's per-tile offset lists (the plan stands in for them elsewhere: the pointer is unused)
        listed = tile_offsets(plan, N, cfg["BLOCK_N"]) if cfg["LISTED"] else plan
        # every kernel argument in signature order; x (slot 0) and y (slot 6, and slot 5 standing in for a missing
        # bias: the pointer is then unused) are filled per call
        args = [None, wop, out_index, plan, listed, bias, None, M, self._pad_c or C, H, W, Ho, Wo, N, S, *y_strides]
        names = _stripe_fwd_kernel.arg_names
        self._args = args + [named.pop(n) for n in names[len(args):]]
        self._y_slots = (5, 6) if bias is None else (6,)
        self._launch_options = named  # num_warps, num_stages
        if self.pdl:
            self._launch_options["launch_pdl"] = True
        self._compiled = None  # Triton's compiled kernel bound to the grid, after the first call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output on ``x``, which must have this launch's ``signature`` (an input of another shape gave
        an output of the prepared shape, and a smaller batch made the kernel read past x's end)."""
        got = input_signature(x)
        if got != self.signature:
            shape, dtype, device, strides, aligned = got
            raise ValueError(
                f"stripe conv launcher: prepared for inputs of shape {self.signature[0]}, {self.signature[1]} on "
                f"{self.signature[2]}, strides {self.signature[3]}, 16-byte aligned {self.signature[4]}; got shape "
                f"{shape}, {dtype} on {device}, strides {strides}, aligned {aligned}. Prepare a launcher for this input "
                "(kernels.prepare_stripe_conv2d), or call kernels.stripe_conv2d")
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` without the signature check, for callers that matched ``input_signature(x)`` already
        (``StripeConv2d`` keys its launcher by it)."""
        y = x.new_empty_strided(self._y_shape, self._y_strides)
        if self._M:
            self._run(x, y)
        return max_pool2x2(y, self._pool_ceil) if self._pool_after else y

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        args = self._args
        if self._pad_c:
            B, C, H, W = x.shape
            xp = torch.empty((B, H, W, self._pad_c), dtype=x.dtype, device=x.device)
            xp[..., :C] = x.permute(0, 2, 3, 1)
            xp[..., C:] = 0
            args[0] = xp
        else:
            args[0] = x if self._x_cl else x.contiguous(memory_format=torch.channels_last)
        for i in self._y_slots:
            args[i] = y
        try:
            if self._compiled is not None:
                self._compiled(*args)
            else:
                kernel = _stripe_fwd_kernel[self._grid](*args, **self._launch_options)
                if isinstance(kernel, CompiledKernel):  # (the interpreter returns none)
                    self._compiled = kernel[self._grid]  # bound to the grid once, not per call
        finally:  # hold no activations between calls
            args[0] = None
            for i in self._y_slots:
                args[i] = None


# ----------------------------------------------------------------------------------------------- backward
# For narrow layers (where cuDNN's backward kernels are far from memory speed) the backward runs here:
# - grad_x (stride 1): the transposed conv is a stride-1 conv of the output gradient with the flipped, transposed
#   dense weight, W'[c, o, kh, kw] = W[o, c, KH-1-kh, KW-1-kw], padding d*(K-1) - p: the forward kernel's DENSE
#   route runs it (every offset: the pruned stripes of the N filters leave no stripe of W' empty in general);
# - grad_weight: dW viewed as (N, KH*KW*C) is G^T @ Xcat (G: output gradient rows, Xcat: the im2col rows, column
#   k*C + c = input channel c at kernel offset k). One program per (slice of the output pixels, chunk of up to 256
#   columns) accumulates its part on tensor cores, reading G once for all the offsets of its chunk, and writes it
#   to its own slot of a partial-sum buffer; a sum over the slices (deterministic, no atomics) and a gather of the
#   kept stripes follow. (A first version, one program per single offset, read G 9 times and took 0.88-2.8x
#   cuDNN's wgrad time.)
# Both compute dense products (no pruned stripe is skipped). On an H200 the grad_x route beats cuDNN's dgrad only
# up to 16 output channels (1.06-1.91x; 1.7-3.1x slower from 24; benchmarks/results/stripe_bwd_gpu_h200.json), the
# grad_weight kernel up to 24 channels in bf16 (1.14-1.36x; 0.88x at 32) and 32 in fp32 (1.40-1.82x; 0.3-0.45x
# from 40; stripe_bwd_gpu_h200_wgrad_cat.json): kernels.stripe._triton_backward_parts takes each there.
# Tried and dropped (H200, bf16, 2026-11-22): a backward that skips the pruned stripes. Seen from the backward the
# pruned (output channel, offset) pairs lie on the reduction side, so grad_x = G~ @ w and grad_w = G~^T @ x are
# implicit GEMMs over the kept stripes only (G~[p, s]: the output gradient of stripe s's channel at the output pixel
# input pixel p meets through s's offset; one flat loop over the S stripes, each column gathered at its own shift).
# Correct (2.9e-3 relative), but gathering 2-byte elements from the channels_last gradient one by one (no vector or
# cp.async loads) dominates: on the layer shapes at keep 0.3 and 0.15 grad_x took 0.6-6.3x cuDNN's dense
# dgrad time and grad_w 0.5-3.4x its wgrad, 2.5-18x the dense backward per kept MAC, with per-element index math
# made separable (per-pixel base and validity bits, per-stripe shift) and a register double buffer
# (stripe_bwd_gather_v{1,2,3}_reverted_h200.json; kernels and sweep: stripe_bwd_gather_*reverted.py.txt). It won only
# at 16 channels (where the pieces above already run; its grad_w 1.2-1.4x faster than theirs) and for 32-channel
# grad_w (1.1-1.8x cuDNN's): too little for a second backward kernel.
def backward_support(x, out_channels: int, kernel_size, stride, padding, dilation) -> tuple[bool, bool]:
    """(grad_x, grad_weight): whether ``backward`` can compute each for this layer (grad_x: stride 1, at most 64
    output channels; grad_weight: at most 64 input and output channels)."""
    C, N = x.shape[1], out_channels
    ok_x = (tuple(stride) == (1, 1) and N <= 64
            and all(d * (k - 1) >= p for d, k, p in zip(dilation, kernel_size, padding)))
    return ok_x, C <= 64 and N <= 64


if triton is not None:

    @triton.jit
    def _wgrad_kernel(
        g_ptr, x_ptr, part_ptr,
        m_per, M, H, W, Ho, Wo,
        C: tl.constexpr, N: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, IS_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BN: tl.constexpr, KCB: tl.constexpr,
    ):
        # part[slice, o, j] = sum over the slice's output pixels m of g[m, o] * xcat[m, j] for the columns
        # j = k*C + c in [j0, j0 + KCB) of the im2col row xcat[m] (input channel c at kernel offset k of pixel m):
        # one tensor-core product per pixel block covers KCB / C offsets, so g is read once for all of them and
        # the shifted input rows of neighbouring offsets come from the same cache lines
        pid = tl.program_id(0)
        j0 = tl.program_id(1) * KCB
        m_start = pid * m_per
        m_end = tl.minimum(m_start + m_per, M)
        ns = tl.arange(0, BN)
        # element (m, j) of xcat sits at pixel m's unshifted row + a column shift that does not depend on m, computed
        # once here: the per-element address is one add (computing the whole index per element was slower)
        js = j0 + tl.arange(0, KCB)
        dh, dw, shift, j_ok = _im2col_columns(js, C, W, DH, DW, KH, KW)
        acc = tl.zeros((BN, KCB), dtype=tl.float32)
        for m0 in range(m_start, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < m_end
            jw = offs_m % Wo
            t = offs_m // Wo
            ih0 = (t % Ho) * SH - PH
            iw0 = jw * SW - PW
            row0 = (((t // Ho).to(tl.int64) * H + ih0) * W + iw0) * C
            g = tl.load(g_ptr + (offs_m.to(tl.int64) * N)[:, None] + ns[None, :],
                        mask=m_ok[:, None] & (ns < N)[None, :], other=0.0)
            xa = _im2col_load(x_ptr, row0, ih0, iw0, m_ok, dh, dw, shift, j_ok, H, W)
            if IS_FP32:
                g = _round_tf32(g)
                xa = _round_tf32(xa)
            acc = tl.dot(tl.trans(g), xa, acc)
        off = (pid * N + ns[:, None]) * (KH * KW * C) + js[None, :]
        tl.store(part_ptr + off, acc, mask=(ns < N)[:, None] & j_ok[None, :])


_FULL_PLANS: dict = {}


def _full_plan(K: int, N: int, device) -> torch.Tensor:
    """The plan of a layer keeping every stripe: plan[k, n] = k*N + n (cached per shape and device)."""
    key = (K, N, str(device))
    if key not in _FULL_PLANS:
        _FULL_PLANS[key] = (torch.arange(K, device=device)[:, None] * N
                            + torch.arange(N + 1, device=device)[None, :]).to(torch.int32)
    return _FULL_PLANS[key]


def _grad_input(grad, dense_w, kernel_size, padding, dilation):
    """grad_x of a stride-1 conv with the dense weight dense_w (N, C, KH, KW), by the forward kernel's DENSE route."""
    N, C, KH, KW = dense_w.shape
    flipped = dense_w.transpose(0, 1).flip((2, 3)).contiguous(memory_format=torch.channels_last)  # (C, KH, KW, N)
    pad = [d * (k - 1) - p for d, k, p in zip(dilation, kernel_size, padding)]
    plan = _full_plan(KH * KW, C, grad.device)
    # the tiles a forward producing grad_x's pixel count takes
    pixels = out_pixels(grad, kernel_size, (1, 1), pad, dilation)
    cfg = default_config(N, C, KH * KW * C, KH * KW, grad.dtype, dense_given=True, pixels=pixels)
    cfg["DENSE"] = not cfg.get("IM2COL", False)  # route (a), or route (c) where the config takes it
    return Launch(grad, flipped, plan, plan, None, C, KH * KW * C, kernel_size, (1, 1), pad, dilation, False,
                  cfg)(grad)


def _grad_weight(grad, x, out_index, offset, N, kernel_size, stride, padding, dilation):
    """grad of the kept stripes (S, C) in float32: the dense weight gradient by ``_wgrad_kernel``, then a gather."""
    B, C, H, W = x.shape
    KH, KW = kernel_size
    Ho, Wo = grad.shape[2:]
    M = B * Ho * Wo
    if M == 0:  # an empty batch: nothing to launch (the pixel slices below would be empty)
        return x.new_zeros((out_index.numel(), C), dtype=torch.float32)
    kc = KH * KW * C  # im2col columns
    kcb = _pow2(kc, 16, 256) if kc <= 256 else 128
    bn = _pow2(N, 16, 64)
    block_m = 32
    chunks = triton.cdiv(kc, kcb)
    # about 4 programs per SM over (pixel slices x column chunks), each slice a whole number of BLOCK_M steps
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4  # 4: interpreter
    slices = max(1, min(triton.cdiv(4 * sms, chunks), triton.cdiv(M, block_m)))
    m_per = triton.cdiv(triton.cdiv(M, slices), block_m) * block_m
    slices = triton.cdiv(M, m_per)
    part = torch.empty((slices, N, KH * KW, C), device=x.device, dtype=torch.float32)
    _wgrad_kernel[(slices, chunks)](
        grad.contiguous(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last), part,
        m_per, M, H, W, Ho, Wo, C, N, SH=stride[0], SW=stride[1], PH=padding[0], PW=padding[1], DH=dilation[0],
        DW=dilation[1], KH=KH, KW=KW, IS_FP32=x.dtype == torch.float32, BLOCK_M=block_m, BN=bn, KCB=kcb,
        num_warps=4, num_stages=3)
    return part.sum(0).view(N * KH * KW, C)[stripe_rows(out_index, offset, kernel_size)]


def backward(grad, x, weight, out_index, offset, out_channels, kernel_size, stride, padding, dilation, need_x,
             need_w, dense_w=None):
    """(grad_x or None, grad_weight or None) for a layer ``backward_support`` allows (each one asked for must be
    supported); grad_x in x's layout, grad_weight in weight's dtype. ``dense_w``: the zero-filled dense weight
    (``stripe_to_dense``, any layout) if the caller has it; grad_x reads it."""
    ok_x, ok_w = backward_support(x, out_channels, kernel_size, stride, padding, dilation)
    if (need_x and not ok_x) or (need_w and not ok_w):
        raise ValueError(f"stripe_triton.backward: layer {tuple(x.shape)} -> {out_channels} channels, stride "
                         f"{list(stride)}: grad_x {'un' * (not ok_x)}supported, grad_weight "
                         f"{'un' * (not ok_w)}supported here; use the cuDNN backward")
    dx = dw = None
    if need_x:
        if dense_w is None:
            dense_w = stripe_to_dense(weight, out_index, offset, out_channels, kernel_size)
        dx = _grad_input(grad, dense_w, kernel_size, padding, dilation).contiguous(memory_format=memory_format(x))
    if need_w:
        dw = _grad_weight(grad, x, out_index, offset, out_channels, kernel_size, stride, padding, dilation)
        dw = dw.to(weight.dtype)
    return dx, dw
