"""Experimental input-stationary stripe kernel ("halo" route): a program owns R whole output rows of one image;
it loads the input rows they read (with the kernel's halo) ONCE, multiplies them by a chunk of stripes
(P[halo pixel, stripe] = x . w_s, tensor cores), then gathers for each output pixel and stripe the P value at
the pixel's shifted position (tl.gather along the pixel axis) and sums the stripes into their output channels
with a one-hot product. Stride 1 only; C <= BLOCK_K (one channel step); N <= BLOCK_N (one channel tile)."""
import torch
import triton
import triton.language as tl

from kernels._utils import conv_out_size


@triton.jit
def _halo_kernel(x_ptr, w_ptr, oi_ptr, ko_ptr, b_ptr, y_ptr,
                 S, H, W, Ho, Wo, R, n_row_tiles,
                 C: tl.constexpr, N: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr,
                 DW: tl.constexpr, KW: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RELU: tl.constexpr, POOL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // n_row_tiles
    i0 = (pid % n_row_tiles) * R
    r0 = i0 - PH  # first input row of the halo
    # halo tile: BLOCK_H flat pixels over input rows r0.., all W columns
    q = tl.arange(0, BLOCK_H)
    hr = r0 + q // W
    hc = q % W
    h_ok = (hr >= 0) & (hr < H)  # halo rows past the tile's are loaded but never gathered
    ck = tl.arange(0, BLOCK_K)
    a = tl.load(x_ptr + ((b.to(tl.int64) * H + hr) * W + hc)[:, None] * C + ck[None, :],
                mask=h_ok[:, None] & (ck < C)[None, :], other=0.0)
    # output pixels of the tile
    m = tl.arange(0, BLOCK_M)
    if POOL:  # window-major: rows 4q'..4q'+3 are the 2x2 window of pooled pixel q'
        qm = m // 4
        win = m % 4
        oi = i0 + (qm // (Wo // 2)) * 2 + win // 2
        oj = (qm % (Wo // 2)) * 2 + win % 2
        m_ok = (qm < (R // 2) * (Wo // 2)) & (oi < Ho)
    else:
        oi = i0 + m // Wo
        oj = m % Wo
        m_ok = (m < R * Wo) & (oi < Ho)
    cols = tl.arange(0, BLOCK_N)
    cc = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, S, CHUNK):
        st = s0 + cc
        s_ok = st < S
        wt = tl.load(w_ptr + st[None, :].to(tl.int64) * C + ck[:, None], mask=s_ok[None, :] & (ck < C)[:, None],
                     other=0.0)
        p = tl.dot(a, wt).to(x_ptr.dtype.element_ty)  # (BLOCK_H, CHUNK)
        k = tl.load(ko_ptr + st, mask=s_ok, other=0)
        o = tl.load(oi_ptr + st, mask=s_ok, other=-1)
        kh = k // KW
        kw = k % KW
        ii = oi[:, None] + (kh * DH)[None, :] - PH  # input row of (pixel, stripe)
        jj = oj[:, None] + (kw * DW)[None, :] - PW
        ok = m_ok[:, None] & s_ok[None, :] & (ii >= 0) & (ii < H) & (jj >= 0) & (jj < W)
        idx = tl.where(ok, (ii - r0) * W + jj, 0)
        g = tl.gather(p, idx, 0)
        g = tl.where(ok, g, 0.0)
        onehot = (o[:, None] == cols[None, :]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(g, onehot, acc)
    n_ok = cols < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    if POOL:
        acc = tl.max(tl.reshape(acc, (BLOCK_M // 4, 4, BLOCK_N)), axis=1)
        qq = tl.arange(0, BLOCK_M // 4)
        pi = i0 // 2 + qq // (Wo // 2)
        pj = qq % (Wo // 2)
        q_ok = (qq < (R // 2) * (Wo // 2)) & (pi < Ho // 2)
        y_off = (((b.to(tl.int64) * (Ho // 2) + pi) * (Wo // 2) + pj) * N)[:, None] + cols[None, :]
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=q_ok[:, None] & n_ok[None, :])
    else:
        y_off = (((b.to(tl.int64) * Ho + oi) * Wo + oj) * N)[:, None] + cols[None, :]
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def halo_forward(x, weight, out_index, offset, bias, N, kernel_size, padding, dilation, relu, pool=False,
                 BLOCK_M=128, CHUNK=64, num_warps=8, num_stages=1):
    B, C, H, W = x.shape
    KH, KW = kernel_size
    Ho, Wo = conv_out_size(H, KH, 1, padding[0], dilation[0]), conv_out_size(W, KW, 1, padding[1], dilation[1])
    R = max(1, BLOCK_M // Wo)
    if pool:
        R -= R % 2
    RH = R - 1 + (KH - 1) * dilation[0] + 1
    BLOCK_H = triton.next_power_of_2(RH * W)
    n_row_tiles = triton.cdiv(Ho, R)
    x = x.contiguous(memory_format=torch.channels_last)
    ko = (offset[:, 0] * KW + offset[:, 1]).to(torch.int32)
    oi = out_index.to(torch.int32)
    shape = (B, N, Ho // 2, Wo // 2) if pool else (B, N, Ho, Wo)
    y = torch.empty(shape, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    _halo_kernel[(B * n_row_tiles,)](
        x, weight.contiguous(), oi, ko, bias if bias is not None else y, y, weight.shape[0], H, W, Ho, Wo, R,
        n_row_tiles, C=C, N=N, PH=padding[0], PW=padding[1], DH=dilation[0], DW=dilation[1], KW=KW,
        HAS_BIAS=bias is not None, RELU=relu, POOL=pool, BLOCK_M=BLOCK_M, BLOCK_H=BLOCK_H,
        BLOCK_K=max(16, triton.next_power_of_2(C)), BLOCK_N=max(16, triton.next_power_of_2(N)), CHUNK=CHUNK,
        num_warps=num_warps, num_stages=num_stages)
    return y
