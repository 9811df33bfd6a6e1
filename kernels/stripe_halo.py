"""Halo route of the stripe conv forward: CUDA C++ (``kernels/csrc/stripe_halo.cu``), inference only, float16 and
bfloat16, channels_last, stride 1 (any kernel size, padding and dilation).

A tile is ``tile_rows`` output rows of one image; persistent blocks (as many as fit on the GPU) loop over tiles,
copying the next tile's input rows (with the halo) into shared memory while they compute this one. Per tile a block
multiplies every staged input position by every stripe once (a small GEMM on
tensor cores, fp32 results kept in shared memory), then sums each output channel's stripes at their shifted
positions, adds the bias, applies ReLU and the 2x2 max-pool if asked, and writes channels_last. Its multiply-adds
are the kept stripes' times (tile_rows + KH - 1) / tile_rows, where the implicit-GEMM route of
``kernels/stripe_triton.py`` multiplies dense tiles (every output channel of a tile at every offset one of them
keeps): on the narrow, sparse layers SWP leaves, that is most of its work.

``HaloPlan`` (``prepare``, once per layer): the stripe weights sorted by output channel and zero-padded to
(S_pad, C_pad), multiples of 16; each stripe's flat offset ``kh*KW + kw``; and ``fstart`` (N+1,), channel o's
stripes being ``[fstart[o], fstart[o+1])``. The whole tile must fit in shared memory (``smem_bytes``):
``tile_rows`` picks the tallest tile within ``SMEM_BUDGET`` that still gives every SM work, None when not even
one row (two when pooling) fits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels import _ext
from kernels._utils import conv_out_size

SMEM_BUDGET = 110 * 1024  # bytes per block: two blocks per SM on an H100/H200 (227 KiB)
THREADS = 256  # per block, as in stripe_halo.cu


class HaloPlan(NamedTuple):
    weight: Tensor  # (S_pad, C_pad), stripes sorted by output channel, zero-padded
    offsets: Tensor  # (S,) int32: kh * KW + kw of each stripe, same order
    fstart: Tensor  # (N + 1,) int32: output channel o's stripes are [fstart[o], fstart[o + 1])


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def prepare(weight: Tensor, out_index: Tensor, offset: Tensor, out_channels: int, kernel_size) -> HaloPlan:
    """The layer's ``HaloPlan`` (on weight's device, in weight's dtype) from the stripe op's arguments: weight (S, C),
    out_index (S,) and offset (S, 2) int64, in any stripe order."""
    S, C = weight.shape
    KW = kernel_size[1]
    flat = offset[:, 0] * KW + offset[:, 1]
    order = torch.argsort(out_index * (kernel_size[0] * KW) + flat)
    w = weight.new_zeros(max(_pad16(S), 16), _pad16(C))
    w[:S, :C] = weight[order]
    counts = torch.bincount(out_index, minlength=out_channels)
    fstart = torch.zeros(out_channels + 1, dtype=torch.int32, device=weight.device)
    fstart[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return HaloPlan(w, flat[order].to(torch.int32).contiguous(), fstart)


def smem_bytes(tile_rows: int, out_w: int, in_channels: int, num_stripes: int, out_channels: int, kernel_size,
               dilation, element_size: int) -> int:
    """Shared memory of one block (as ``halo_smem_bytes`` in stripe_halo.cu): the fp32 stripe results of the staged
    positions, two staged inputs (this tile's and the next one's), the stripe weights, and the stripe and channel
    tables."""
    qh = tile_rows + (kernel_size[0] - 1) * dilation[0]
    qw = out_w + (kernel_size[1] - 1) * dilation[1]
    q_pad, c_ld, s_pad = _pad16(qh * qw), _pad16(in_channels) + 8, max(_pad16(num_stripes), 16)
    return q_pad * (s_pad + 8) * 4 + (2 * q_pad + s_pad) * c_ld * element_size + (num_stripes + out_channels + 1) * 4


def tile_rows(batch: int, out_hw, in_channels: int, num_stripes: int, out_channels: int, kernel_size, dilation,
              element_size: int, pool: bool, sms: int) -> int | None:
    """Output rows per tile: the tallest tile within ``SMEM_BUDGET`` that leaves at least 4 tiles per SM (two per
    block; or the tallest that fits, on small batches), even when pooling; None when none fits."""
    Ho, Wo = out_hw
    step = 2 if pool else 1
    fitting = [t for t in range(step, max(Ho, step) + 1, step)
               if smem_bytes(t, Wo, in_channels, num_stripes, out_channels, kernel_size, dilation,
                             element_size) <= SMEM_BUDGET]
    if not fitting:
        return None
    busy = [t for t in fitting if batch * -(-Ho // t) >= 4 * sms]
    return max(busy or fitting)


def applies(x: Tensor, stride) -> bool:
    """Whether the halo kernel can run on x: CUDA float16/bfloat16, channels_last, stride 1, extension built."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and tuple(stride) == (1, 1)
            and x.is_contiguous(memory_format=torch.channels_last) and _ext.available())


def forward(x: Tensor, plan: HaloPlan, bias: Tensor | None, out_channels: int, kernel_size, padding, dilation,
            relu: bool, pool: bool, pool_ceil: bool, rows: int) -> Tensor:
    """y (B, N, Ho, Wo), or its 2x2 max-pool (``F.max_pool2d(y, 2, ceil_mode=pool_ceil)``) with ``pool``, channels_last,
    of the stride-1 stripe conv of x (channels_last, x's dtype = the plan's) with ``rows`` output rows per block
    (``tile_rows``); ReLU before the pool with ``relu``."""
    return _ext.load().stripe_halo_forward(x, plan.weight, plan.offsets, plan.fstart, bias, int(out_channels),
                                           list(kernel_size), list(padding), list(dilation), int(rows), bool(relu),
                                           bool(pool), bool(pool_ceil))


def out_size(in_hw, kernel_size, padding, dilation) -> tuple[int, int]:
    """(Ho, Wo) of the stride-1 conv."""
    return tuple(conv_out_size(n, k, 1, p, d) for n, k, p, d in zip(in_hw, kernel_size, padding, dilation))
