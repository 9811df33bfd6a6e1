"""A convolution on a tiny feature map as one GEMM with an unrolled weight (``StripeConv2d``'s "gemm" mode).

For an input of H x W pixels the conv is linear in the whole image, so with x stored channels_last each image is
one row of H*W*C values and each output image one row of Ho*Wo*N values (channels_last again)::

    y_rows (B, Ho*Wo*N) = x_rows (B, H*W*C) @ U^T + bias_rows,   U[(i, j, o), (p, q, c)] = W[o, c, kh, kw]

where input pixel (p, q) = (i*sh - ph + kh*dh, j*sw - pw + kw*dw) and U is 0 for pixel pairs the kernel does not
join. Both views are free (no copy) for a channels_last x. cuBLASLt runs the product with the bias and the ReLU in
its epilogue (``torch._addmm_activation``), one kernel.

U has H*W / (KH*KW) times the conv's multiply-adds (for a 3x3 conv with padding 1: 4/9 at 2x2, where the conv's
per-offset form computes 9 offsets of which only 4 fall inside, and 16/9 at 4x4). Why: at these sizes the dense
conv is latency-bound. On an H200 (bf16, channels_last, batch 256, the real-mask VGG16's unpooled 2x2 and 4x4
layers, CUDA graphs) the product took 0.0038-0.0071 ms where cuDNN's conv + bias + ReLU took 0.0093-0.0110 ms
(benchmarks/unroll_probe_gpu.py -> unroll_probe_h200.json); at 8x8 (64/9 the MACs) it was 1.3-3.1x slower than
cuDNN. A pooling layer pools after the product (F.max_pool2d, about 4 us there; one reduction over a view of the
rows was no faster).
``fits`` bounds it to H*W <= 2*KH*KW and a weight of at most ``MAX_BYTES``.

Non-finite inputs: U's zeros meet every input value, so an inf or NaN anywhere in an image makes the rest of its
output image NaN (0 * inf), where a conv keeps it to the value's receptive field. Finding it first would cost a pass over
x and, on CUDA, a host sync per layer, so the GEMM form keeps this behaviour (README, "Compaction").
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels._utils import conv_out_size

MAX_BYTES = 32 * 2**20  # the unrolled weight's size bound (bytes)


def fits(in_channels: int, out_channels: int, in_hw, kernel_size, stride, padding, dilation,
         element_size: int) -> bool:
    """Whether the GEMM form is offered for this conv on an input of spatial size ``in_hw``: at most twice the
    conv's multiply-adds (H*W <= 2*KH*KW), an output of at least one pixel, and a weight of at most
    ``MAX_BYTES``."""
    (H, W), (KH, KW) = in_hw, kernel_size
    Ho, Wo = (conv_out_size(*a) for a in zip(in_hw, kernel_size, stride, padding, dilation))
    if Ho < 1 or Wo < 1 or H * W > 2 * KH * KW:
        return False
    return Ho * Wo * out_channels * H * W * in_channels * element_size <= MAX_BYTES


def unrolled_weight(dense: Tensor, in_hw, stride, padding, dilation) -> tuple[Tensor, tuple[int, int]]:
    """U (Ho*Wo*N, H*W*C), rows (i, j, o) and columns (p, q, c) in that order, from the dense weight (N, C, KH, KW)
    of a conv on H x W inputs; returns (U, (Ho, Wo)). Exact: each entry is one weight value or 0."""
    N, C, KH, KW = dense.shape
    H, W = in_hw
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    Ho, Wo = conv_out_size(H, KH, sh, ph, dh), conv_out_size(W, KW, sw, pw, dw)
    u = dense.new_zeros(Ho, Wo, N, H, W, C)
    for i in range(Ho):
        for j in range(Wo):
            for kh in range(KH):
                for kw in range(KW):
                    p, q = i * sh - ph + kh * dh, j * sw - pw + kw * dw
                    if 0 <= p < H and 0 <= q < W:
                        u[i, j, :, p, q, :] = dense[:, :, kh, kw]
    return u.view(Ho * Wo * N, H * W * C), (Ho, Wo)


def unrolled_operands(dense: Tensor, bias: Tensor | None, in_hw, stride, padding,
                      dilation) -> tuple[Tensor, Tensor | None, tuple[int, int]]:
    """(U, bias rows, (Ho, Wo)) for ``unrolled_conv2d``: ``unrolled_weight(dense, ...)`` and the bias (N,) repeated
    per output pixel (Ho*Wo*N,) in dense's dtype, or None without a bias."""
    u, out_hw = unrolled_weight(dense, in_hw, stride, padding, dilation)
    return u, None if bias is None else bias.to(dense.dtype).repeat(out_hw[0] * out_hw[1]), out_hw


def unrolled_conv2d(x: Tensor, u: Tensor, bias_rows: Tensor | None, out_hw, relu: bool,
                    memory_format: torch.memory_format = torch.channels_last) -> Tensor:
    """The conv of x (B, C, H, W) through its unrolled weight u (``unrolled_weight``); ``bias_rows``: the bias
    repeated per output pixel (Ho*Wo*N,) or None. Returns (B, N, Ho, Wo) laid out as ``memory_format``
    (channels_last: a view of the product; otherwise a copy)."""
    B, C, H, W = x.shape
    Ho, Wo = out_hw
    rows = x.permute(0, 2, 3, 1).reshape(B, H * W * C)  # a view for channels_last x
    if relu and bias_rows is not None:
        y = torch._addmm_activation(bias_rows, rows, u.t())  # cuBLASLt: bias and ReLU in the GEMM's epilogue
    else:
        y = rows @ u.t() if bias_rows is None else torch.addmm(bias_rows, rows, u.t())
        if relu:
            y = y.relu_()
    y = y.view(B, Ho, Wo, u.shape[0] // (Ho * Wo)).permute(0, 3, 1, 2)  # (not -1: B may be 0)
    return y if memory_format == torch.channels_last else y.contiguous(memory_format=memory_format)
