"""Stripe convolution (Stripe-Wise Pruning) as the custom op ``compress::stripe_conv2d``.

A pruned conv keeps S stripes; stripe s has weight ``w_s`` (C,), output channel ``o_s`` and kernel offset
``(kh_s, kw_s)``. With stride (sh, sw), padding (ph, pw) and dilation (dh, dw) of the source conv::

    y[b, o, i, j] = sum_{s: o_s = o} sum_c w_s[c] * x[b, c, i*sh - ph + kh_s*dh, j*sw - pw + kw_s*dw]  (+ bias[o])

(zero outside the image), i.e. ``F.conv2d`` with the dense weight ``W[o_s, :, kh_s, kw_s] = w_s``. Stripes come in
canonical order: sorted by flat offset ``kh*KW + kw``, then by output channel, at most one stripe per
(offset, channel).

The *plan* (``stripe_plan``) is an int32 table (KH*KW, N+1): ``plan[k, n]`` = number of stripes whose key
``k*N + o`` is below ``k*N + n``. So offset k's stripes are ``[plan[k, 0], plan[k, N])`` and, within them, those
for output channels ``[n0, n1)`` are ``[plan[k, n0], plan[k, n1])``. Build it once per layer (``StripeConv2d`` keeps
it as a non-persistent buffer) and pass it in; without it the op builds it on every call.

The CUDA kernel's dense route reads the zero-filled dense weight, ``stripe_to_dense(...,
memory_format=torch.channels_last)``. An inference caller that keeps that tensor (``StripeConv2d`` caches it like its
dense mode) passes it as ``dense``: the kernel then takes the dense route up to 64 input channels and on most
16-bit wider layers (``stripe_reads_dense``). Without it the op takes that route only for C <= 16 or mostly-kept
layers and builds the weight on every call (two small kernels, about as long as such a layer on an H200).

CUDA path: the Triton kernel in ``kernels/stripe_triton.py`` (forward); backward by cuDNN's dense backward with the
zero-filled weight, then the kept stripes of its weight gradient, except on narrow layers, where
``stripe_triton.backward`` computes grad_x (stride 1, with the forward kernel) and grad_weight (an im2col product)
(see ``_triton_backward_parts``).

CPU path (also the CUDA fallback and the float64 path): one GEMM of all stripes over the input (a 1x1 conv,
``(S, C) @ (C, B*H*W)``) followed by one strided ``index_add_`` per offset into the output channels (a loop over
the <= KH*KW offsets, never over stripes or pixels). Backward: ``grad_x`` is one GEMM ``W^T @ G`` where G holds
each stripe's output gradient placed at its shifted input positions; ``grad_weight = G @ x^T``.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import unrolled
from kernels._utils import (
    INDEX_LIMIT,
    autocast_inputs,
    check_4d,
    check_conv_output,
    check_conv_params,
    check_like,
    contiguous_input,
    conv2d_relu,
    conv_out_size,
    memory_format,
    needs_standard_ops,
    pair,
    tracing_or_compiling,
    whole,
)
from kernels.pool import max_pool2x2

__all__ = ["stripe_conv2d", "prepare_stripe_conv2d", "stripe_plan", "stripe_to_dense", "stripe_rows",
           "stripe_reads_dense", "stripe_route", "stripe_cost", "dense_trim", "trimmed_dense"]

OP = "compress::stripe_conv2d"
BOP = "compress::stripe_conv2d_backward"


# ----------------------------------------------------------------------------------------------- checks
def _check_index(op: str, out_index: Tensor, offset: Tensor, S: int, device, on: str = "x") -> None:
    """out_index (S,) and offset (S, 2), int64 tensors on `device`, the device of tensor `on`."""
    for nm, t, shape in (("out_index", out_index, (S,)), ("offset", offset, (S, 2))):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: '{nm}' must be a Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise TypeError(f"{op}: tensor '{nm}' must be int64, got {t.dtype}")
        # (under torch.jit.trace the sizes are traced values, and comparing them warns; eager calls check them)
        if not torch.jit.is_tracing() and tuple(t.shape) != shape:
            raise ValueError(f"{op}: tensor '{nm}' must have shape {shape}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{op}: tensor '{nm}' is on {t.device} but '{on}' is on {device}")


def _check(x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor, bias: Tensor | None, plan,
           out_channels: int, kernel_size, stride, padding, dilation, op: str = OP, dense: Tensor | None = None):
    check_4d(op, "x", x)
    check_like(op, "weight", weight, x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: tensor 'weight' must have shape (S, {x.shape[1]}) for x with {x.shape[1]} "
                         f"channels, got {tuple(weight.shape)}")
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(f"{op}: tensor 'x' must be contiguous NCHW or channels_last, got strides {x.stride()}")
    S = weight.shape[0]
    _check_index(op, out_index, offset, S, x.device)
    if out_channels < 1:
        raise ValueError(f"{op}: out_channels must be >= 1, got {out_channels}")
    if len(kernel_size) != 2 or min(kernel_size) < 1:
        raise ValueError(f"{op}: kernel_size must be two ints >= 1, got {list(kernel_size)}")
    if bias is not None:
        check_like(op, "bias", bias, x)
        if tuple(bias.shape) != (out_channels,):
            raise ValueError(f"{op}: tensor 'bias' must have shape ({out_channels},), got {tuple(bias.shape)}")
    if plan is not None:
        K = kernel_size[0] * kernel_size[1]
        if plan.dtype != torch.int32 or tuple(plan.shape) != (K, out_channels + 1) or plan.device != x.device:
            raise ValueError(f"{op}: tensor 'plan' must be int32 of shape ({K}, {out_channels + 1}) on "
                             f"{x.device} (from kernels.stripe_plan), got {plan.dtype} {tuple(plan.shape)} "
                             f"on {plan.device}")
        # its last entry counts the stripes; read only on the CPU (a CUDA read would sync, and break a capture)
        if plan.device.type == "cpu" and type(plan) is Tensor and not tracing_or_compiling() and int(plan[-1, -1]) != S:
            raise ValueError(f"{op}: tensor 'plan' counts {int(plan[-1, -1])} stripes but 'weight' has {S}: it "
                             "belongs to other indices; rebuild it with kernels.stripe_plan(out_index, offset, ...)")
    check_conv_params(op, stride, padding, dilation)
    ho, wo = check_conv_output(op, x, kernel_size, stride, padding, dilation)
    if dense is not None:
        _check_dense(dense, weight, out_channels, kernel_size, op)
    return ho, wo


def _check_dense(dense: Tensor, weight: Tensor, out_channels: int, kernel_size, op: str = OP) -> None:
    """``dense`` must be laid out as ``stripe_to_dense(..., memory_format=torch.channels_last)`` returns it."""
    KH, KW = kernel_size
    C = weight.shape[1]
    shape, strides = (out_channels, C, KH, KW), (KH * KW * C, 1, KW * C, C)
    if (tuple(dense.shape) != shape or dense.stride() != strides or dense.dtype != weight.dtype
            or dense.device != weight.device):
        raise ValueError(f"{op}: tensor 'dense' must be the zero-filled dense weight {shape} with strides {strides} "
                         f"(channels_last), {weight.dtype} on {weight.device}, as "
                         f"stripe_to_dense(weight, out_index, offset, N, kernel_size, memory_format=torch.channels_last) "
                         f"returns it; got {tuple(dense.shape)} strides {dense.stride()} {dense.dtype} on {dense.device}")


# ----------------------------------------------------------------------------------------------- plan
def _plan_torch(out_index: Tensor, offset: Tensor, out_channels: int, kernel_size) -> Tensor:
    KH, KW = kernel_size
    K, N = KH * KW, out_channels
    key = offset[:, 0] * KW + offset[:, 1]
    key = key * N + out_index
    counts = torch.bincount(key, minlength=K * N) if key.numel() else key.new_zeros(K * N)
    excl = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # (K*N + 1,)
    idx = torch.arange(K, device=key.device)[:, None] * N + torch.arange(N + 1, device=key.device)[None, :]
    return excl[idx].to(torch.int32)


def stripe_plan(out_index: Tensor, offset: Tensor, out_channels: int, kernel_size, validate: bool = True) -> Tensor:
    """Index table of a stripe layer: int32 (KH*KW, N+1), see the module docstring. Build it once per layer.

    With ``validate`` (the default; it reads the indices on the host once) it checks ranges and canonical order.
    """
    kernel_size = pair(kernel_size, "kernel_size")
    if min(kernel_size) < 1:
        raise ValueError(f"stripe_plan: kernel_size must be two ints >= 1, got {kernel_size}")
    if isinstance(out_index, Tensor) and out_index.dim() != 1:
        raise ValueError(f"stripe_plan: tensor 'out_index' must be 1-D (S,), got shape {tuple(out_index.shape)}")
    S = out_index.shape[0] if isinstance(out_index, Tensor) else 0  # (_check_index refuses a non-tensor)
    _check_index("stripe_plan", out_index, offset, S, getattr(out_index, "device", None))
    if validate:
        _validate_indices("stripe_plan", out_index, offset, out_channels, kernel_size)
    return _plan_torch(out_index, offset, out_channels, kernel_size)


def _validate_indices(op: str, out_index: Tensor, offset: Tensor, out_channels: int, kernel_size,
                      order: bool = True) -> None:
    """ValueError unless the stripes' output channels and offsets are in range and (with `order`) in canonical order
    (a host read of the indices: ``stripe_plan`` does it once per layer; the ops do it on calls without a plan)."""
    if out_index.shape[0] == 0:
        return
    KH, KW = kernel_size
    o, kh, kw = out_index.cpu(), offset[:, 0].cpu(), offset[:, 1].cpu()
    if int(o.min()) < 0 or int(o.max()) >= out_channels:
        raise ValueError(f"{op}: 'out_index' values must lie in [0, {out_channels}), got [{int(o.min())}, "
                         f"{int(o.max())}]")
    if int(kh.min()) < 0 or int(kh.max()) >= KH or int(kw.min()) < 0 or int(kw.max()) >= KW:
        raise ValueError(f"{op}: 'offset' values must lie in [0, {KH}) x [0, {KW}) for kernel {(KH, KW)}")
    key = (kh * KW + kw) * out_channels + o
    if order and len(key) > 1 and not bool((key[1:] > key[:-1]).all()):
        raise ValueError(f"{op}: stripes must be in canonical order (sorted by offset kh*KW+kw, then output "
                         "channel) with at most one stripe per (offset, output channel)")


def stripe_rows(out_index: Tensor, offset: Tensor, kernel_size) -> Tensor:
    """Each stripe's row ``(o*KH + kh)*KW + kw`` in the dense weight viewed as (N*KH*KW, C) (int64 (S,)); a layer
    that rebuilds its dense weight often computes this once (``stripe_to_dense(..., rows=)``)."""
    KH, KW = pair(kernel_size, "kernel_size")
    return (out_index * KH + offset[:, 0]) * KW + offset[:, 1]


def stripe_to_dense(weight: Tensor, out_index: Tensor, offset: Tensor, out_channels: int, kernel_size,
                    memory_format: torch.memory_format = torch.contiguous_format, rows: Tensor | None = None) -> Tensor:
    """Zero-filled dense weight (N, C, KH, KW) with ``W[o_s, :, kh_s, kw_s] = weight[s]`` (differentiable), laid
    out as ``memory_format``. It is built as (N*KH*KW, C) rows, which is the channels_last layout itself: for
    ``torch.channels_last`` no copy follows (one zero fill and one row scatter; its gradient is one gather).
    ``rows``: ``stripe_rows(out_index, offset, kernel_size)``, if kept from before. The indices' ranges are checked on
    the host where they are plain CPU tensors (elsewhere they must be valid: ``stripe_plan`` checks them once)."""
    op = "stripe_to_dense"
    if memory_format not in (torch.contiguous_format, torch.channels_last):
        raise ValueError(f"{op}: memory_format={memory_format}; give torch.contiguous_format or "
                         "torch.channels_last (a new weight has no layout to preserve)")
    KH, KW = pair(kernel_size, "kernel_size")
    if weight.dim() != 2:
        raise ValueError(f"{op}: tensor 'weight' must have shape (S, C), the kept stripes, got {tuple(weight.shape)}")
    S, C = weight.shape
    _check_index(op, out_index, offset, S, weight.device, on="weight")
    if rows is None and out_index.device.type == "cpu" and type(out_index) is Tensor and not tracing_or_compiling():
        _validate_indices(op, out_index, offset, out_channels, (KH, KW), order=False)  # (any order adds up)
    flat = weight.new_zeros(out_channels * KH * KW, C)
    flat = flat.index_add(0, stripe_rows(out_index, offset, kernel_size) if rows is None else rows, weight)
    dense = flat.view(out_channels, KH, KW, C).permute(0, 3, 1, 2)  # channels_last strides, also for C == 1
    # clone, not contiguous(): with C == 1 the view already counts as contiguous but has channels_last strides,
    # which would make a conv return channels_last output for an NCHW input
    return dense if memory_format == torch.channels_last else dense.clone(memory_format=memory_format)


def dense_trim(offset: Tensor, kernel_size, padding, dilation) -> tuple[int, int]:
    """(rows, cols) of kernel-offset rings, from the outside in, that no stripe uses and the padding covers
    (``padding // dilation``): a dense conv with the weight cut to ``[r:KH-r, c:KW-c]`` and padding ``p - r*d``
    gives the same output (same size: the window stays centred). For example a 3x3 layer that kept only centre
    stripes, common in the deep layers of SWP models, is a 1x1 conv. ``offset`` (S, 2) on any device; S = 0
    trims nothing."""
    KH, KW = pair(kernel_size, "kernel_size")
    if offset.numel() == 0:
        return 0, 0
    kh, kw = offset[:, 0], offset[:, 1]
    r = min(int(torch.minimum(kh, KH - 1 - kh).min()), pair(padding)[0] // pair(dilation)[0])
    c = min(int(torch.minimum(kw, KW - 1 - kw).min()), pair(padding)[1] // pair(dilation)[1])
    return r, c


def trimmed_dense(dense: Tensor, trim: tuple[int, int], padding, dilation,
                  memory_format: torch.memory_format) -> tuple[Tensor, list[int]]:
    """(weight, padding) of the dense conv cut by ``trim`` (``dense_trim``): the centred window of ``dense``
    (N, C, KH, KW) laid out as ``memory_format`` (a copy; differentiable), and the padding reduced to match;
    ``dense`` itself where nothing is cut."""
    (r, c), (ph, pw), (dh, dw) = trim, pair(padding), pair(dilation)
    if not (r or c):
        return dense, [ph, pw]
    KH, KW = dense.shape[2:]
    return dense[:, :, r:KH - r, c:KW - c].clone(memory_format=memory_format), [ph - r * dh, pw - c * dw]


def _segments(plan: Tensor | None, out_index, offset, N, kernel_size):
    """Per offset k: (k, start, end) of its stripes, host ints (CPU/fallback path only)."""
    if plan is None:
        plan = _plan_torch(out_index, offset, N, kernel_size)
    ends = plan[:, [0, N]].tolist()
    return [(k, a, b) for k, (a, b) in enumerate(ends) if b > a]


def _valid(n_out: int, n_in: int, r0: int, s: int):
    """Output index range [i0, i1) whose input index i*s + r0 lies in [0, n_in)."""
    i0 = max(0, (-r0 + s - 1) // s)
    i1 = min(n_out, (n_in - 1 - r0) // s + 1)
    return i0, max(i0, i1)


def _windows(k, KW, H, W, ho, wo, stride, padding, dilation):
    """For offset k: output slice (i0:i1, j0:j1) and the matching strided input slices (rows, cols)."""
    kh, kw = divmod(k, KW)
    r0, c0 = kh * dilation[0] - padding[0], kw * dilation[1] - padding[1]
    i0, i1 = _valid(ho, H, r0, stride[0])
    j0, j1 = _valid(wo, W, c0, stride[1])
    if i1 <= i0 or j1 <= j0:
        return None
    rows = slice(i0 * stride[0] + r0, (i1 - 1) * stride[0] + r0 + 1, stride[0])
    cols = slice(j0 * stride[1] + c0, (j1 - 1) * stride[1] + c0 + 1, stride[1])
    return slice(i0, i1), slice(j0, j1), rows, cols


# ----------------------------------------------------------------------------------------------- torch path
_HALF = (torch.float16, torch.bfloat16)


def _forward_torch(x, weight, out_index, offset, bias, plan, N, kernel_size, stride, padding, dilation, relu):
    if torch.is_autocast_enabled(x.device.type):  # the op's inputs are cast already (stripe_conv2d); its GEMM and
        with torch.autocast(x.device.type, enabled=False):  # scatter-add must not be cast again, apart
            return _forward_torch(x, weight, out_index, offset, bias, plan, N, kernel_size, stride, padding,
                                  dilation, relu)
    if x.dtype in _HALF:  # float32 products and sums over the offsets, rounded once (as a 16-bit conv accumulates)
        y = _forward_torch(x.float(), weight.float(), out_index, offset, None if bias is None else bias.float(), plan,
                           N, kernel_size, stride, padding, dilation, relu)
        return y.to(x.dtype)
    B, C, H, W = x.shape
    ho = conv_out_size(H, kernel_size[0], stride[0], padding[0], dilation[0])
    wo = conv_out_size(W, kernel_size[1], stride[1], padding[1], dilation[1])
    S = weight.shape[0]
    # y in (N, B, Ho, Wo) so that the per-offset scatter is an index_add_ along dim 0 of whole planes
    if bias is not None:
        y = bias.view(N, 1, 1, 1).expand(N, B, ho, wo).clone()
    else:
        y = x.new_zeros(N, B, ho, wo)
    if S > 0 and B > 0:
        xc = x.transpose(0, 1).reshape(C, B * H * W)
        p = torch.mm(weight, xc).view(S, B, H, W)  # every stripe at every input pixel
        for k, a, b in _segments(plan, out_index, offset, N, kernel_size):
            win = _windows(k, kernel_size[1], H, W, ho, wo, stride, padding, dilation)
            if win is None:
                continue
            oi, oj, rows, cols = win
            y[:, :, oi, oj].index_add_(0, out_index[a:b], p[a:b, :, rows, cols])
    if relu:
        y.clamp_min_(0)
    out = y.permute(1, 0, 2, 3).contiguous(memory_format=memory_format(x))
    # with one output channel or one image the permuted view is already contiguous: return a tensor of its own
    # (an op output that is a view breaks autograd's in-place checks, e.g. a following ReLU(inplace=True))
    return out if out._base is None else out.clone(memory_format=memory_format(x))


def _backward_torch(grad, x, weight, out_index, offset, plan, N, kernel_size, stride, padding, dilation,
                    need_x: bool, need_w: bool):
    if torch.is_autocast_enabled(x.device.type):  # as in _forward_torch
        with torch.autocast(x.device.type, enabled=False):
            return _backward_torch(grad, x, weight, out_index, offset, plan, N, kernel_size, stride, padding,
                                   dilation, need_x, need_w)
    if x.dtype in _HALF:  # in float32, as the forward
        dx, dw = _backward_torch(grad.float(), x.float(), weight.float(), out_index, offset, plan, N, kernel_size,
                                 stride, padding, dilation, need_x, need_w)
        return (None if dx is None else dx.to(x.dtype)), (None if dw is None else dw.to(weight.dtype))
    B, C, H, W = x.shape
    S = weight.shape[0]
    ho, wo = grad.shape[2:]
    dx = dw = None
    if S == 0 or B == 0:
        dx = torch.zeros_like(x, memory_format=memory_format(x)) if need_x else None
        dw = torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_w else None
        return dx, dw
    # G[s, b, h, w] = grad[b, o_s, i, j] at the input pixel (h, w) that stripe s reads for output (i, j)
    gt = grad.transpose(0, 1)  # (N, B, Ho, Wo) view
    g = x.new_zeros(S, B, H, W)
    for k, a, b in _segments(plan, out_index, offset, N, kernel_size):
        win = _windows(k, kernel_size[1], H, W, ho, wo, stride, padding, dilation)
        if win is None:
            continue
        oi, oj, rows, cols = win
        g[a:b, :, rows, cols] = gt[:, :, oi, oj].index_select(0, out_index[a:b])
    g2 = g.view(S, B * H * W)
    if need_x:
        dx = torch.mm(weight.t(), g2).view(C, B, H, W).permute(1, 0, 2, 3)
        dx = dx.contiguous(memory_format=memory_format(x))
    if need_w:
        dw = torch.mm(g2, x.transpose(0, 1).reshape(C, B * H * W).t())
    return dx, dw


# ----------------------------------------------------------------------------------------------- ops
def _check_call(x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor, bias: Tensor | None, plan,
                out_channels: int, kernel_size, stride, padding, dilation, dense: Tensor | None) -> tuple[int, int]:
    """A forward call's checks: `_check`, and without a plan the indices (on the host); (Ho, Wo)."""
    size = _check(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
                  dense=dense)
    if plan is None:
        _validate_indices(OP, out_index, offset, out_channels, kernel_size)
    return size


def _triton_fits(x: Tensor, out_channels: int, ho: int, wo: int) -> bool:
    """Whether the Triton kernels' 32-bit index math covers a call (else the PyTorch path): pixel rows (B*Ho*Wo;
    B*H*W for the backward's grad_x) and one image's output or input channel planes (N*Ho*Wo, C*H*W) below
    ``INDEX_LIMIT``. x and y themselves may be larger: the kernels offset pixel rows in 64 bits (edge case
    stripe/large_index_gt_2^31)."""
    B, C, H, W = x.shape
    return max(B * ho * wo, B * H * W, out_channels * ho * wo, C * H * W) < INDEX_LIMIT


@torch.library.custom_op(OP, mutates_args=())
def _stripe_op(x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor, bias: Tensor | None,
               plan: Tensor | None, out_channels: int, kernel_size: list[int], stride: list[int],
               padding: list[int], dilation: list[int], relu: bool, dense: Tensor | None = None) -> Tensor:
    # the CPU path does not read `dense` (its GEMM runs on the stripes); it is checked all the same
    _check_call(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation, dense)
    return _forward_torch(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding,
                          dilation, relu)


@_stripe_op.register_kernel("cuda")
def _stripe_cuda(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding,
                 dilation, relu, dense=None):
    ho, wo = _check_call(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding,
                         dilation, dense)
    from kernels import stripe_triton

    if plan is None:
        plan = _plan_torch(out_index, offset, out_channels, kernel_size)
    if stripe_triton.available(x) and _triton_fits(x, out_channels, ho, wo):
        return stripe_triton.forward(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride,
                                     padding, dilation, relu, dense=dense)
    return _forward_torch(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding,
                          dilation, relu)


@_stripe_op.register_fake
def _stripe_fake(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
                 relu, dense=None):
    ho, wo = _check(x, weight, out_index, offset, bias, plan, out_channels, kernel_size, stride, padding, dilation,
                    dense=dense)
    return x.new_empty((x.shape[0], out_channels, ho, wo)).contiguous(memory_format=memory_format(x))


@torch.library.custom_op(BOP, mutates_args=())
def _stripe_backward_op(grad: Tensor, x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor,
                        plan: Tensor | None, out_channels: int, kernel_size: list[int], stride: list[int],
                        padding: list[int], dilation: list[int], need_x: bool, need_w: bool,
                        dense: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """grad_x and grad_weight (placeholders where not needed). ``dense``: the forward's channels_last zero-filled
    weight, if it had one (the CUDA path reads it instead of building it again)."""
    _check_grad(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding, dilation)
    if plan is None:
        _validate_indices(BOP, out_index, offset, out_channels, kernel_size)
    dx, dw = _backward_torch(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding,
                             dilation, need_x, need_w)
    return _fill(dx, dw, x, weight)


@_stripe_backward_op.register_kernel("cuda")
def _stripe_backward_cuda(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding,
                          dilation, need_x, need_w, dense=None):
    _check_grad(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding, dilation)
    if plan is None:
        _validate_indices(BOP, out_index, offset, out_channels, kernel_size)
    if dense is not None:
        _check_dense(dense, weight, out_channels, kernel_size, BOP)
    if x.dtype == torch.float64:
        dx, dw = _backward_torch(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride,
                                 padding, dilation, need_x, need_w)
        return _fill(dx, dw, x, weight)
    tri_x, tri_w = (_triton_backward_parts(x, out_channels, kernel_size, stride, padding, dilation)
                    if _triton_fits(x, out_channels, *grad.shape[2:]) else (False, False))
    tri_x, tri_w = tri_x and need_x, tri_w and need_w
    cud_x, cud_w = need_x and not tri_x, need_w and not tri_w
    # the zero-filled weight, in x's layout, for whichever of cuDNN's backward and the Triton grad_x reads it: the
    # forward's where it matches, else built once here
    wd = None
    if tri_x or cud_x or cud_w:
        fmt = memory_format(x)
        wd = (dense if dense is not None and fmt == torch.channels_last
              else stripe_to_dense(weight, out_index, offset, out_channels, kernel_size, memory_format=fmt))
    dx = dw = None
    if tri_x or tri_w:
        from kernels import stripe_triton

        dx, dw = stripe_triton.backward(grad, x, weight, out_index, offset, out_channels, kernel_size, stride,
                                        padding, dilation, tri_x, tri_w, dense_w=wd)
    if cud_x or cud_w:
        cx, cw = _backward_dense(grad, x, wd, out_index, offset, stride, padding, dilation, cud_x, cud_w)
        dx, dw = (cx if cud_x else dx), (cw if cud_w else dw)
    return _fill(dx, dw, x, weight)


_BWD_ENV = "COMPRESS_STRIPE_BWD"


def _triton_backward_parts(x, out_channels, kernel_size, stride, padding, dilation) -> tuple[bool, bool]:
    """(grad_x, grad_weight) by the Triton backward rather than cuDNN's dense backward. By default where it was
    faster on an H200 (benchmarks/stripe_bwd_gpu.py, bf16/fp32, random masks): grad_x of stride-1 layers with at
    most 16 output channels (1.06-1.91x faster than cuDNN's dgrad; 1.7-3.1x slower from 24;
    stripe_bwd_gpu_h200.json; rerun in session 17 with the weight given as the op gives it and the forward's
    tiles for the gradient's size: 1.39-2.36x up to 16 channels, 0.61-1.06x from 24, so the rule stayed;
    stripe_bwd_gpu_h200_session17.json); grad_weight of layers with at most 32 output channels and 24 input channels in
    16-bit, 32 in float32 (1.14-1.36x faster than cuDNN's wgrad in bf16 up to 24 channels, 0.88x at 32;
    1.40-1.82x in fp32 up to 32, 0.45x from 40; stripe_bwd_gpu_h200_wgrad_cat.json).
    ``COMPRESS_STRIPE_BWD=triton`` takes it wherever it is supported, ``=cudnn`` nowhere (A/B runs)."""
    from kernels import stripe_triton

    choice = os.environ.get(_BWD_ENV, "auto")
    if choice not in ("auto", "triton", "cudnn"):
        raise ValueError(f"{_BWD_ENV} must be 'auto', 'triton' or 'cudnn', got {choice!r}")
    if choice == "cudnn" or not stripe_triton.available(x):
        return False, False
    ok_x, ok_w = stripe_triton.backward_support(x, out_channels, kernel_size, stride, padding, dilation)
    if choice == "triton":
        return ok_x, ok_w
    narrow_w = x.shape[1] <= (32 if x.dtype == torch.float32 else 24) and out_channels <= 32
    return ok_x and out_channels <= 16, ok_w and narrow_w


def _backward_dense(grad, x, wd, out_index, offset, stride, padding, dilation, need_x, need_w):
    """cuDNN's dense conv backward with the zero-filled weight wd (``stripe_to_dense`` in x's layout), then the
    kept stripes of its weight gradient (exact)."""
    fmt = memory_format(x)
    dx, dW, _ = torch.ops.aten.convolution_backward(grad, x, wd, None, stride, padding, dilation, False, [0, 0], 1,
                                                    [need_x, need_w, False])
    dw = dW[out_index, :, offset[:, 0], offset[:, 1]] if need_w else None
    return (dx.contiguous(memory_format=fmt) if need_x else None), dw


def _fill(dx, dw, x, weight):
    # the op always returns two tensors; unrequested ones are empty placeholders of the right shape
    if dx is None:
        dx = torch.empty_like(x, memory_format=memory_format(x))
    if dw is None:
        dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    return dx, dw


def _check_grad(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding, dilation):
    ho, wo = _check(x, weight, out_index, offset, None, plan, out_channels, kernel_size, stride, padding, dilation,
                    BOP)
    check_4d(BOP, "grad", grad)
    check_like(BOP, "grad", grad, x)
    if tuple(grad.shape) != (x.shape[0], out_channels, ho, wo):
        raise ValueError(f"{BOP}: tensor 'grad' must have shape {(x.shape[0], out_channels, ho, wo)}, "
                         f"got {tuple(grad.shape)}")


@_stripe_backward_op.register_fake
def _stripe_backward_fake(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding,
                          dilation, need_x, need_w, dense=None):
    _check_grad(grad, x, weight, out_index, offset, plan, out_channels, kernel_size, stride, padding, dilation)
    return torch.empty_like(x, memory_format=memory_format(x)), torch.empty_like(
        weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, out_index, offset, bias, plan, N, ks, stride, padding, dilation, relu, dense = inputs
    ctx.save_for_backward(x, weight, out_index, offset, plan, output if relu else None, dense)
    ctx.conf = (N, ks, stride, padding, dilation)
    ctx.has_bias, ctx.relu = bias is not None, relu


def _backward(ctx, grad):
    x, weight, out_index, offset, plan, y, dense = ctx.saved_tensors
    if ctx.relu:
        grad = torch.ops.aten.threshold_backward(grad, y, 0)  # grad where y > 0, else 0 (ReLU's backward)
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[4]
    dx = dw = db = None
    if need_x or need_w:
        gx, gw = _stripe_backward_op(grad.contiguous(memory_format=memory_format(grad)), x, weight, out_index,
                                     offset, plan, *ctx.conf, need_x, need_w, dense)
        dx, dw = (gx if need_x else None), (gw if need_w else None)
    if ctx.has_bias and need_b:
        db = grad.sum((0, 2, 3))
    return dx, dw, None, None, db, None, None, None, None, None, None, None, None  # `dense` is a cache: no gradient


_stripe_op.register_autograd(_backward, setup_context=_setup_context)


def _setup_backward_context(ctx, inputs, output):
    grad, x, weight, out_index, offset, plan, N, ks, stride, padding, dilation, need_x, need_w, dense = inputs
    ctx.save_for_backward(grad, x, weight, out_index, offset, plan)
    ctx.conf = (N, ks, stride, padding, dilation)


def _double_backward(ctx, ggx, ggw):
    """The backward op's own gradient (double backward: gradient penalties, Hessian-vector products). Its outputs
    are bilinear, gx = conv_transpose(grad, W) and gw = wgrad(x, grad), so with ggx, ggw the gradients of gx, gw:
    d/d grad = conv(ggx, W) + conv(x, ggw) (two forward ops), and (d/dx, d/dW) = (conv_transpose(grad, ggw),
    wgrad(ggx, grad)): the backward op itself with x := ggx and W := ggw."""
    grad, x, weight, out_index, offset, plan = ctx.saved_tensors
    conf = ctx.conf
    ggx = None if ggx is None else ggx.contiguous(memory_format=memory_format(ggx))
    need_grad, need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    d_grad = d_x = d_w = None
    if need_grad and ggx is not None:
        d_grad = _stripe_op(ggx, weight, out_index, offset, None, plan, *conf, False)
    if need_grad and ggw is not None:
        part = _stripe_op(x, ggw.contiguous(), out_index, offset, None, plan, *conf, False)
        d_grad = part if d_grad is None else d_grad + part
    if (need_x and ggw is not None) or (need_w and ggx is not None):
        as_x = ggx if ggx is not None else torch.zeros_like(x, memory_format=memory_format(x))  # x := ggx
        as_w = ggw.contiguous() if ggw is not None else torch.zeros_like(weight)  # W := ggw
        want_x, want_w = need_x and ggw is not None, need_w and ggx is not None
        gx, gw = _stripe_backward_op(grad.contiguous(memory_format=memory_format(grad)), as_x, as_w, out_index,
                                     offset, plan, *conf, want_x, want_w)
        d_x, d_w = (gx if want_x else None), (gw if want_w else None)
    return (d_grad, d_x, d_w) + (None,) * 11


_stripe_backward_op.register_autograd(_double_backward, setup_context=_setup_backward_context)


# ----------------------------------------------------------------------------------------------- public
def stripe_conv2d(x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor, bias: Tensor | None,
                  out_channels: int, kernel_size, stride=1, padding=0, dilation=1, relu: bool = False,
                  plan: Tensor | None = None, dense: Tensor | None = None) -> Tensor:
    """Stripe convolution, equal to ``F.conv2d`` with the zero-filled dense weight (see ``stripe_to_dense``).

    Args:
        x: (B, C, H, W); read as it is when contiguous NCHW or channels_last, else copied to contiguous NCHW.
        weight: (S, C) kept stripes, canonical order.  out_index: (S,) int64.  offset: (S, 2) int64 (kh, kw).
        bias: (N,) or None.  out_channels: N.  kernel_size, stride, padding, dilation: int or pair.
        relu: apply ReLU after the bias (fused in the CUDA kernel).
        plan: ``stripe_plan(out_index, offset, N, kernel_size)``, built (and the indices validated) once per layer;
            without it every call checks the indices on the host (ranges, canonical order) and builds the table.
        dense: ``stripe_to_dense(weight, out_index, offset, N, kernel_size, memory_format=torch.channels_last)``,
            kept by the caller for inference (optional; no gradient flows into it). The CUDA kernel's dense route
            (``stripe_reads_dense``) reads it instead of building it per call; it must equal the stripes.

    Returns:
        y: (B, N, Ho, Wo), channels_last if ``x`` is.
    """
    if isinstance(x, Tensor):
        x = contiguous_input(x)
    x, weight, bias, dense = autocast_inputs(x, weight, bias, dense)
    n, k, geometry = (whole(out_channels, "stripe_conv2d: out_channels"), pair(kernel_size, "kernel_size"),
                      (pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")))
    if needs_standard_ops():  # torch.func, forward-mode AD: F.conv2d on the zero-filled weight, the same function
        _check_call(x, weight, out_index, offset, bias, plan, n, k, *geometry, dense)
        y = F.conv2d(x, stripe_to_dense(weight, out_index, offset, n, k), bias, *geometry)
        return y.relu() if relu else y
    return _stripe_op(x, weight, out_index, offset, bias, plan, n, k, *geometry, bool(relu), dense)


def prepare_stripe_conv2d(x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor, bias: Tensor | None,
                          out_channels: int, kernel_size, stride=1, padding=0, dilation=1, relu: bool = False,
                          plan: Tensor | None = None, dense: Tensor | None = None, pool: bool = False,
                          pool_ceil: bool = False, tile_keep: dict[int, float] | None = None):
    """An inference launcher of ``stripe_conv2d`` for inputs like ``x``: ``launch = prepare_stripe_conv2d(x, ...)``,
    then ``launch(x2)`` == ``stripe_conv2d(x2, ...)`` for any x2 with ``launch.signature ==
    kernels.stripe_triton.input_signature(x2)`` (another input is refused with a ValueError; ``launch.run(x2)``
    skips that check, for callers that keyed the launcher by the signature). Arguments as ``stripe_conv2d``, checked here once; the tensors are
    held, so in-place changes to them show in later calls (a new ``dense`` needs a new launcher). ``pool``: the
    launcher returns ``F.max_pool2d(y, 2, ceil_mode=pool_ceil)`` instead, pooled in the kernel's epilogue for even
    output sizes (``kernels.stripe_triton.pool_fusable``), else after it. ``tile_keep``: ``stripe_tile_keep(plan,
    out_channels)``, kept with the layer; with ``dense`` it lets tiles of output channels that share few kernel
    offsets (masks shared by groups of filters) skip the others (``kernels.stripe_triton.default_config``).

    The launcher skips the op's dispatch, checks, route choice and Triton's per-call JIT binding (see
    ``kernels.stripe_triton.Launch``), and it records no autograd graph and applies no autocast: a caller uses it
    only where no gradient is needed, with every tensor already in x's dtype. Returns None where the op would not
    run the Triton kernel (not CUDA, float64, no Triton, an input or output of about 2^31 elements or more); call ``stripe_conv2d`` then.
    """
    from kernels import stripe_triton

    ks, st, pd, dl = (pair(v, nm) for v, nm in ((kernel_size, "kernel_size"), (stride, "stride"),
                                                 (padding, "padding"), (dilation, "dilation")))
    out_channels = whole(out_channels, "prepare_stripe_conv2d: out_channels")
    ho, wo = _check(x, weight, out_index, offset, bias, plan, out_channels, ks, st, pd, dl, dense=dense)
    if not (stripe_triton.available(x) and _triton_fits(x, out_channels, ho, wo)):
        return None
    if plan is None:
        plan = stripe_plan(out_index, offset, out_channels, ks)  # validated once: the launcher is kept
    return stripe_triton.prepare(x, weight, out_index, offset, bias, plan, out_channels, ks, st, pd, dl,
                                 bool(relu), dense=dense, pool=bool(pool), pool_ceil=bool(pool_ceil),
                                 tile_keep=tile_keep)


def stripe_tile_keep(plan: Tensor, out_channels: int) -> dict[int, float]:
    """{tile width: share of the (kernel offset, tile of that many output channels) blocks keeping a stripe} for
    tiles of 16-128 channels (``kernels.stripe_triton.tile_keep``): 1 for nearly any random mask, the kept share of
    stripes where groups of filters share their offsets. One host read: call it once per plan."""
    from kernels import stripe_triton

    return stripe_triton.tile_keep(plan, whole(out_channels, "stripe_tile_keep: out_channels"))


def stripe_reads_dense(x: Tensor, weight: Tensor, out_channels: int, kernel_size, stride=1, padding=0,
                       dilation=1, tile_keep: dict[int, float] | None = None) -> bool:
    """Whether ``stripe_conv2d`` on ``x``, given the zero-filled dense weight as ``dense``, runs a CUDA kernel route
    that reads it (the dense route, or the im2col route: at most 4 input channels, 5-8 in 16-bit types, or
    17-64): CUDA float32/16/bf16 with Triton, up to 64 input channels, 16-bit layers from 65 channels but sparse
    ones of 512+ output channels, or with many stripes kept (``kernels.stripe_triton.default_config(...,
    dense_given=True)``). Without ``dense`` the kernel takes those routes only for C <= 16 or many stripes, and
    builds the weight on every call. ``tile_keep``: as ``prepare_stripe_conv2d``'s."""
    from kernels import stripe_triton

    if not stripe_triton.available(x):
        return False
    ks, st, pd, dl = (pair(v, nm) for v, nm in ((kernel_size, "kernel_size"), (stride, "stride"),
                                                 (padding, "padding"), (dilation, "dilation")))
    cfg = stripe_triton.default_config(x.shape[1], whole(out_channels, "stripe_reads_dense: out_channels"), weight.shape[0], ks[0] * ks[1], x.dtype,
                                       dense_given=True, pixels=stripe_triton.out_pixels(x, ks, st, pd, dl),
                                       tile_keep=tile_keep)
    return stripe_triton.reads_dense(cfg)


# ----------------------------------------------------------------------------------------------- route choice
def stripe_cost(in_channels: int, out_channels: int, num_stripes: int, kernel_size, device: str = "cpu",
                tile_keep: dict[int, float] | None = None) -> float:
    """Cost-model estimate of (stripe time / dense time) for a layer; < 1 means the stripe path should win.

    CPU: the stripe path does the 1x1 GEMM (S*C per input pixel) plus a scatter of S values per pixel, against the
    dense conv's N*KH*KW*C MACs per output pixel; a rough fit (+-40%) to benchmarks/stripe_cpu.py on the shared
    2-core CPU, so prefer ``stripe_route`` (a measurement) where the layer can be timed once.
    CUDA: a per-width fit to the H200 measurements (benchmarks/stripe_gpu.py); with ``tile_keep``
    (``stripe_tile_keep``; from 16 input channels) at most 3x its smallest share, the LISTED route's cost per kept
    offset (1.6-5x cuDNN's per offset, 2.4-3.2x on most layers; stripe_blocks_gpu_h200_{narrow,wide}.json).
    ``device``: a device or its name ("cuda:0", a torch.device); the CUDA fit for CUDA devices, the CPU one for
    every other.
    """
    KH, KW = pair(kernel_size, "kernel_size")
    for name, v in (("in_channels", in_channels), ("out_channels", out_channels), ("num_stripes", num_stripes)):
        if whole(v, f"stripe_cost: {name}") < 0:
            raise ValueError(f"stripe_cost: {name} must be >= 0, got {v}")
    try:
        kind = torch.device(device).type  # ("cuda:0" and torch.device("cuda") were taken for the CPU)
    except (RuntimeError, TypeError):
        raise ValueError(f"stripe_cost: device must be a device or its name ('cpu', 'cuda', 'cuda:0', a "
                         f"torch.device), got {device!r}") from None
    dense = out_channels * KH * KW * in_channels
    if kind == "cuda":
        # H200 fit (stripe_gpu_h200_kept_dense.json and stripe_gpu_h200.json, random masks, the dense weight kept as
        # StripeConv2d keeps it): the Triton kernel beats cuDNN 2.0-2.6x at C <= 16, 1.0-1.35x at C = 32, ties at
        # C = 64 (0.91-1.15x) and is 1.3-2.3x slower from C = 128 on (1.15-1.5x in bf16 since session 17,
        # stripe_gpu_h200_wide_session17.json: still slower, so the estimate keeps dense mode there)
        ratio = 0.4 if in_channels <= 16 else (0.85 if in_channels <= 32 else (1.0 if in_channels <= 64 else 1.5))
        if tile_keep and in_channels >= 16:
            ratio = min(ratio, 3.0 * min(tile_keep.values()))
        return ratio
    return (num_stripes * in_channels + 150.0 * num_stripes) / (0.75 * max(dense, 1))


def _eager_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall milliseconds of one synchronised call (launch overhead included)."""
    fn()
    ts = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def _graph_ms(fn, device: torch.device, repeats: int, calls: int = 10) -> float:
    """Median GPU milliseconds per call: CUDA-event timings of a CUDA graph holding `calls` calls (no launch
    overhead: what the layer costs in a graphed or compiled model)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up (Triton compiles, cuDNN's algorithm search) outside the capture
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / calls)
    return sorted(ts)[len(ts) // 2]


@torch.no_grad()
def stripe_route(x: Tensor, weight: Tensor, out_index: Tensor, offset: Tensor, bias: Tensor | None,
                 out_channels: int, kernel_size, stride=1, padding=0, dilation=1, plan: Tensor | None = None,
                 repeats: int = 5, timing: str = "auto", relu: bool = False, pool: bool = False,
                 pool_ceil: bool = False, tile_keep: dict | None = None) -> dict:
    """Measure once which way of running the layer is fastest on ``x``'s device, shape, dtype and layout (like
    ``cudnn.benchmark``): the stripe op, ``F.conv2d`` with the zero-filled dense weight, and, where
    ``kernels.unrolled.fits`` offers it (tiny feature maps), one GEMM with the unrolled weight. Returns
    ``{"mode": "stripe" | "dense" | "gemm", "use_stripe": bool, "stripe_ms", "dense_ms", "gemm_ms"}``
    (``gemm_ms`` None where not offered), the modes named as ``StripeConv2d.mode``.
    ``relu``, ``pool``, ``pool_ceil``: the layer's epilogue (``StripeConv2d.relu``, ``.pool``, ``.pool_ceil``),
    timed on every path as the module runs them: the kernel's epilogue against cuDNN's conv + bias + ReLU call (or
    the GEMM with cuBLASLt's), then ``F.max_pool2d``. ``tile_keep``: ``stripe_tile_keep(plan, out_channels)`` where
    the caller has it (``StripeConv2d.tile_keep``); computed here on CUDA otherwise.

    timing: "graph" (CUDA only) compares GPU time, replaying each path in a CUDA graph: the cost in a graphed or
    compiled model, where launch overhead is gone; "eager" compares the wall time of one synchronised call,
    launch overhead included (about 20 us of host time per call even through the kept launcher, more than a small
    layer's GPU time: the right measure for a model run eagerly); "auto" (default): "graph" on CUDA, else "eager".
    Call it once per layer (at export/load or on the first batch), not per forward. The stripe op runs as
    ``StripeConv2d`` runs it in inference: with the dense weight kept (``dense``) where its route reads it, and on
    CUDA through ``prepare_stripe_conv2d``'s launcher.
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"stripe_route: repeats must be an int >= 1 (timed calls per path), got {repeats!r}")
    if timing == "auto":
        timing = "graph" if x.is_cuda else "eager"
    if timing not in ("graph", "eager"):
        raise ValueError(f"stripe_route: timing must be 'auto', 'graph' or 'eager', got {timing!r}")
    if timing == "graph" and not x.is_cuda:
        raise ValueError(f"stripe_route: timing='graph' times CUDA graphs and needs a CUDA input; x is on {x.device} "
                         "(use timing='eager')")
    ks = pair(kernel_size, "kernel_size")
    st, pd, dl = pair(stride), pair(padding), pair(dilation)
    if plan is None:
        plan = stripe_plan(out_index, offset, out_channels, ks)
    fmt = memory_format(x)
    dense_w = stripe_to_dense(weight, out_index, offset, out_channels, ks, memory_format=fmt)
    kept = None
    if tile_keep is None and x.is_cuda:
        tile_keep = stripe_tile_keep(plan, out_channels)
    if weight.dtype == x.dtype and stripe_reads_dense(x, weight, out_channels, ks, stride, padding, dilation,
                                                      tile_keep):
        # the channels_last weight the kernel reads: dense_w itself for a channels_last x
        kept = dense_w if fmt == torch.channels_last else stripe_to_dense(
            weight, out_index, offset, out_channels, ks, memory_format=torch.channels_last)

    # as StripeConv2d runs it in inference: the prepared launch where the Triton kernel runs (every tensor in x's
    # dtype), else the op
    launch = None
    if weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        launch = prepare_stripe_conv2d(x, weight, out_index, offset, bias, out_channels, ks, stride, padding,
                                       dilation, relu=relu, plan=plan, dense=kept, pool=pool, pool_ceil=pool_ceil,
                                       tile_keep=tile_keep)

    def pooled(y):
        return max_pool2x2(y, pool_ceil) if pool else y

    def run_stripe():
        if launch is not None:
            return launch(x)
        return pooled(stripe_conv2d(x, weight, out_index, offset, bias, out_channels, ks, stride, padding, dilation,
                                    relu=relu, plan=plan, dense=kept))

    dense_mode_w, dense_pad = trimmed_dense(dense_w, dense_trim(offset, ks, padding, dilation), padding, dilation,
                                            fmt)

    def run_dense():  # as StripeConv2d's dense mode
        conv = conv2d_relu if relu else F.conv2d
        return pooled(conv(x, dense_mode_w, bias, st, dense_pad, dl))

    clock = _graph_ms if timing == "graph" else _eager_ms
    ms = {"stripe": clock(run_stripe, x.device, repeats), "dense": clock(run_dense, x.device, repeats)}
    if unrolled.fits(x.shape[1], out_channels, x.shape[2:], ks, st, pd, dl, x.element_size()):
        operands = unrolled.unrolled_operands(dense_w.to(x.dtype), bias, x.shape[2:], st, pd, dl)

        def run_gemm():  # as StripeConv2d's gemm mode
            return pooled(unrolled.unrolled_conv2d(x, *operands, relu=relu, memory_format=fmt))

        ms["gemm"] = clock(run_gemm, x.device, repeats)
    mode = min(ms, key=ms.get)
    return {"mode": mode, "use_stripe": mode == "stripe", "stripe_ms": ms["stripe"], "dense_ms": ms["dense"],
            "gemm_ms": ms.get("gemm")}
