"""2-D convolution through im2col / col2im (seed 002) as the custom op ``compress::conv2d``.

``y = W @ im2col(x)`` per group, a per-channel bias, any stride/padding/dilation/groups; the batch is processed in
chunks so that the column buffer stays under ``COL_BYTES`` (default 256 MiB). CPU (and float64) use
``F.unfold``/``F.fold`` for im2col/col2im; CUDA uses the kernels in ``csrc/im2col.cu``. The GEMMs are
``torch.matmul`` (float32 accumulation for 16-bit types). Same results as ``F.conv2d``, forward and backward.
Under autocast the inputs are cast to the autocast dtype, like ``F.conv2d``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import _ext
from kernels._utils import (
    autocast_inputs,
    check_4d,
    check_conv_output,
    check_conv_params,
    check_like,
    memory_format,
    needs_standard_ops,
    pair,
    register_conv_double_backward,
    use_kernel,
    whole,
)

__all__ = ["conv2d", "Im2colConv2d", "COL_BYTES"]

OP = "compress::conv2d"
BOP = "compress::conv2d_backward"
COL_BYTES = 256 * 2**20


def _check(x, weight, bias, stride, padding, dilation, groups, op=OP):
    check_4d(op, "x", x)
    check_4d(op, "weight", weight)
    check_like(op, "weight", weight, x)
    C, (Co, Cg) = x.shape[1], weight.shape[:2]
    if C == 0:
        raise ValueError(f"{op}: tensor 'x' has no channels (shape {tuple(x.shape)}); a conv needs at least one")
    if groups < 1 or C % groups or Co % groups:
        raise ValueError(f"{op}: groups={groups} must divide the channels of 'x' ({C}) and of 'weight' ({Co})")
    if Cg != C // groups:
        raise ValueError(f"{op}: tensor 'weight' must have shape ({Co}, {C // groups}, kh, kw) for x with {C} "
                         f"channels and groups={groups}, got {tuple(weight.shape)}")
    if bias is not None:
        check_like(op, "bias", bias, x)
        if tuple(bias.shape) != (Co,):
            raise ValueError(f"{op}: tensor 'bias' must have shape ({Co},), got {tuple(bias.shape)}")
    check_conv_params(op, stride, padding, dilation)
    return check_conv_output(op, x, weight.shape[2:], stride, padding, dilation)


def _cols_fns(x: Tensor, kernel, stride, padding, dilation, cols_per_image: int):
    """(im2col, col2im) for x's device: the CUDA kernels when available (one image's column buffer,
    `cols_per_image` elements, the most a chunk holds beyond COL_BYTES, within their index range), else F.unfold /
    F.fold."""
    ext = _ext.load() if (x.is_cuda and use_kernel(x, cols_per_image)) else None
    H, W = x.shape[2:]
    if ext is None:
        return (lambda t: F.unfold(t, kernel, dilation, padding, stride),
                lambda c: F.fold(c, (H, W), kernel, dilation, padding, stride))
    return (lambda t: ext.im2col(t, list(kernel), list(stride), list(padding), list(dilation)),
            lambda c: ext.col2im(c, [H, W], list(kernel), list(stride), list(padding), list(dilation)))


def _chunk(x: Tensor, rows: int, L: int) -> int:
    per = max(1, rows * L * x.element_size())
    return max(1, min(x.shape[0], COL_BYTES // per))


def _forward_impl(x, weight, bias, stride, padding, dilation, groups):
    ho, wo = _check(x, weight, bias, stride, padding, dilation, groups)
    N, C, H, W = x.shape
    Co, Cg, kh, kw = weight.shape
    K, L = Cg * kh * kw, ho * wo
    im2col, _ = _cols_fns(x, (kh, kw), stride, padding, dilation, C * kh * kw * L)
    wm = weight.reshape(groups, Co // groups, K)
    out = x.new_empty((N, Co, ho, wo))
    step = _chunk(x, C * kh * kw, L)
    for n0 in range(0, N, step):  # chunks of the batch bound the column buffer (not a loop over elements)
        xs = x[n0:n0 + step]
        cols = im2col(xs).view(xs.shape[0], groups, K, L)
        out[n0:n0 + step] = torch.matmul(wm, cols).view(xs.shape[0], Co, ho, wo)
    if bias is not None:
        out += bias.view(1, Co, 1, 1)
    return out.contiguous(memory_format=memory_format(x))


def _backward_impl(grad, x, weight, stride, padding, dilation, groups):
    ho, wo = _check(x, weight, None, stride, padding, dilation, groups, BOP)
    N, C, H, W = x.shape
    Co, Cg, kh, kw = weight.shape
    if tuple(grad.shape) != (N, Co, ho, wo):
        raise ValueError(f"{BOP}: tensor 'grad' must have shape {(N, Co, ho, wo)}, got {tuple(grad.shape)}")
    K, L = Cg * kh * kw, ho * wo
    im2col, col2im = _cols_fns(x, (kh, kw), stride, padding, dilation, C * kh * kw * L)
    wm = weight.reshape(groups, Co // groups, K)
    wt = wm.transpose(1, 2)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dw = torch.zeros((groups, Co // groups, K), dtype=acc, device=x.device)
    dx = x.new_empty((N, C, H, W))
    grad = grad.contiguous()
    step = _chunk(x, C * kh * kw, L)
    for n0 in range(0, N, step):
        xs = x[n0:n0 + step]
        n = xs.shape[0]
        gy = grad[n0:n0 + step].reshape(n, groups, Co // groups, L)
        cols = im2col(xs).view(n, groups, K, L)
        dw += torch.matmul(gy, cols.transpose(2, 3)).sum(0, dtype=acc)
        dcols = torch.matmul(wt, gy).reshape(n, C * kh * kw, L)
        dx[n0:n0 + step] = col2im(dcols)
    return dx.contiguous(memory_format=memory_format(x)), dw.to(weight.dtype).view_as(weight).contiguous()


@torch.library.custom_op(OP, mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
             dilation: list[int], groups: int) -> Tensor:
    return _forward_impl(x, weight, bias, stride, padding, dilation, groups)


@_conv_op.register_fake
def _conv_fake(x, weight, bias, stride, padding, dilation, groups):
    ho, wo = _check(x, weight, bias, stride, padding, dilation, groups)
    return x.new_empty((x.shape[0], weight.shape[0], ho, wo)).contiguous(memory_format=memory_format(x))


@torch.library.custom_op(BOP, mutates_args=())
def _conv_backward_op(grad: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                      dilation: list[int], groups: int) -> tuple[Tensor, Tensor]:
    check_4d(BOP, "grad", grad)
    check_like(BOP, "grad", grad, x)
    return _backward_impl(grad, x, weight, stride, padding, dilation, groups)


@_conv_backward_op.register_fake
def _conv_backward_fake(grad, x, weight, stride, padding, dilation, groups):
    _check(x, weight, None, stride, padding, dilation, groups, BOP)
    return torch.empty_like(x, memory_format=memory_format(x)), torch.empty_like(
        weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.conf = (stride, padding, dilation, groups)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = _conv_backward_op(grad, x, weight, *ctx.conf)
    db = grad.sum((0, 2, 3)) if ctx.has_bias else None
    return dx, dw, db, None, None, None, None


_conv_op.register_autograd(_backward, setup_context=_setup_context)
register_conv_double_backward(_conv_backward_op, _conv_op)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """Convolution by im2col + GEMM, equal to ``F.conv2d``.

    Args:
        x: (N, C, H, W), NCHW or channels_last.
        weight: (Co, C // groups, kh, kw).
        bias: (Co,) or None (one value per output channel).
        stride, padding, dilation: int or pair; groups: int.

    Returns:
        y: (N, Co, Ho, Wo), channels_last if ``x`` is.
    """
    x, weight, bias = autocast_inputs(x, weight, bias)
    args = (pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"),
            whole(groups, "conv2d: groups"))
    if needs_standard_ops():  # torch.func, forward-mode AD: F.conv2d, the same function
        _check(x, weight, bias, *args)
        return F.conv2d(x, weight, bias, *args)
    return _conv_op(x, weight, bias, *args)


class Im2colConv2d(nn.Module):
    """``nn.Conv2d`` look-alike running ``compress::conv2d``: (N, C, H, W) -> (N, Co, Ho, Wo),
    weight (Co, C // groups, kh, kw), bias (Co,)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, device=None, dtype=None):
        super().__init__()
        ref = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                        device=device, dtype=dtype)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size, self.stride = ref.kernel_size, ref.stride
        self.padding, self.dilation = ref.padding, ref.dilation
        self.weight, self.bias = ref.weight, ref.bias

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> Im2colConv2d:
        if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            raise ValueError("Im2colConv2d.from_conv needs numeric zero padding")
        m = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                conv.groups, conv.bias is not None)
        m.weight, m.bias = conv.weight, conv.bias
        return m

    def forward(self, x: Tensor) -> Tensor:
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, bias={self.bias is not None}")


