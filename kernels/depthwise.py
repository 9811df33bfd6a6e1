"""Depthwise 2-D convolution as the custom op ``compress::depthwise_conv2d``.

Same results as ``F.conv2d(x, weight, bias, stride, padding, dilation, groups=C)``, forward and backward, any
stride/padding/dilation, float32/float16/bfloat16 (float32 accumulation), NCHW and channels_last. CPU and
float64 use PyTorch's convolution; CUDA NCHW uses the kernels in ``csrc/depthwise.cu``. Under autocast the op
casts its inputs to the autocast dtype, like ``F.conv2d``.

channels_last on CUDA is dispatched to cuDNN (``F.conv2d(groups=C)`` forward, ``aten.convolution_backward``
backward): our channels_last kernels (a generic one-output-per-thread kernel) measured 0.1-0.3x of cuDNN on an
H200 (benchmarks/results/kernels_h200.json, rows ``layout: cl``), so the op never runs them silently.
``COMPRESS_DW_CL_KERNEL=1`` forces them (tests and A/B measurements).
"""

from __future__ import annotations

import os

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
    deterministic,
    memory_format,
    needs_standard_ops,
    pair,
    register_conv_double_backward,
    use_kernel,
)

__all__ = ["depthwise_conv2d", "DepthwiseConv2d"]

OP = "compress::depthwise_conv2d"


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, op: str = OP):
    check_4d(op, "x", x)
    check_4d(op, "weight", weight)
    check_like(op, "weight", weight, x)
    C = x.shape[1]
    if C == 0:
        raise ValueError(f"{op}: tensor 'x' has no channels (shape {tuple(x.shape)}); a conv needs at least one")
    if weight.shape[0] != C or weight.shape[1] != 1:
        raise ValueError(f"{op}: tensor 'weight' must have shape ({C}, 1, kh, kw) for x with {C} channels, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        check_like(op, "bias", bias, x)
        if tuple(bias.shape) != (C,):
            raise ValueError(f"{op}: tensor 'bias' must have shape ({C},), got {tuple(bias.shape)}")
    check_conv_params(op, stride, padding, dilation)
    return check_conv_output(op, x, weight.shape[2:], stride, padding, dilation)


def _to_cudnn(x: Tensor) -> bool:
    """channels_last goes to cuDNN (faster than our channels_last kernels) unless COMPRESS_DW_CL_KERNEL=1."""
    return memory_format(x) == torch.channels_last and os.environ.get("COMPRESS_DW_CL_KERNEL", "0") != "1"


@torch.library.custom_op(OP, mutates_args=())
def _dw_op(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
           dilation: list[int]) -> Tensor:
    _check(x, weight, bias, stride, padding, dilation)
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups=x.shape[1])
    return y.contiguous(memory_format=memory_format(x))


@_dw_op.register_kernel("cuda")
def _dw_cuda(x, weight, bias, stride, padding, dilation):
    ho, wo = _check(x, weight, bias, stride, padding, dilation)
    ext = _ext.load() if use_kernel(x, x.shape[0] * x.shape[1] * ho * wo) and not _to_cudnn(x) else None
    if ext is None or x.numel() == 0:
        y = F.conv2d(x, weight, bias, stride, padding, dilation, groups=x.shape[1])
        return y.contiguous(memory_format=memory_format(x))
    fmt = memory_format(x)
    return ext.dw_forward(x.contiguous(memory_format=fmt), weight.contiguous(),
                          None if bias is None else bias.contiguous(), list(stride), list(padding),
                          list(dilation), fmt == torch.channels_last)


@_dw_op.register_fake
def _dw_fake(x, weight, bias, stride, padding, dilation):
    ho, wo = _check(x, weight, bias, stride, padding, dilation)
    return x.new_empty((x.shape[0], x.shape[1], ho, wo)).contiguous(memory_format=memory_format(x))


BOP = "compress::depthwise_conv2d_backward"


@torch.library.custom_op(BOP, mutates_args=())
def _dw_backward_op(grad: Tensor, x: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                    dilation: list[int]) -> tuple[Tensor, Tensor]:
    _check_grad(grad, x, weight, stride, padding, dilation)
    return _dw_backward_torch(grad, x, weight, stride, padding, dilation)


def _check_grad(grad, x, weight, stride, padding, dilation) -> None:
    ho, wo = _check(x, weight, None, stride, padding, dilation, BOP)
    check_4d(BOP, "grad", grad)
    check_like(BOP, "grad", grad, x)
    if tuple(grad.shape) != (x.shape[0], x.shape[1], ho, wo):
        raise ValueError(f"{BOP}: tensor 'grad' must have shape {(x.shape[0], x.shape[1], ho, wo)}, "
                         f"got {tuple(grad.shape)}")


@_dw_backward_op.register_kernel("cuda")
def _dw_backward_cuda(grad, x, weight, stride, padding, dilation):
    _check_grad(grad, x, weight, stride, padding, dilation)
    # (the weight gradient adds blocks' shares with float atomics: cuDNN's path where determinism is asked for)
    ext = _ext.load() if use_kernel(x, grad.numel()) and not _to_cudnn(x) and not deterministic() else None
    if ext is None or x.numel() == 0:
        return _dw_backward_torch(grad, x, weight, stride, padding, dilation)
    fmt = memory_format(x)
    dx, dw = ext.dw_backward(grad.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt),
                             weight.contiguous(), list(stride), list(padding), list(dilation),
                             fmt == torch.channels_last)
    return dx, dw


def _dw_backward_torch(grad, x, weight, stride, padding, dilation):
    dx, dw, _ = torch.ops.aten.convolution_backward(
        grad, x, weight, None, stride, padding, dilation, False, [0, 0], x.shape[1], [True, True, False])
    return dx.contiguous(memory_format=memory_format(x)), dw.contiguous()


@_dw_backward_op.register_fake
def _dw_backward_fake(grad, x, weight, stride, padding, dilation):
    _check(x, weight, None, stride, padding, dilation, BOP)
    return torch.empty_like(x, memory_format=memory_format(x)), torch.empty_like(
        weight, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation = inputs
    ctx.save_for_backward(x, weight)
    ctx.conf = (stride, padding, dilation)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = _dw_backward_op(grad, x, weight, *ctx.conf)
    db = grad.sum((0, 2, 3)) if ctx.has_bias else None
    return dx, dw, db, None, None, None


_dw_op.register_autograd(_backward, setup_context=_setup_context)
register_conv_double_backward(_dw_backward_op, _dw_op)


def depthwise_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                     dilation=1) -> Tensor:
    """Depthwise convolution, equal to ``F.conv2d(..., groups=C)``.

    Args:
        x: (N, C, H, W), NCHW or channels_last.
        weight: (C, 1, kh, kw).
        bias: (C,) or None.
        stride, padding, dilation: int or pair.

    Returns:
        y: (N, C, Ho, Wo), channels_last if ``x`` is.
    """
    x, weight, bias = autocast_inputs(x, weight, bias)
    args = (pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"))
    if needs_standard_ops():  # torch.func, forward-mode AD: F.conv2d, the same function
        _check(x, weight, bias, *args)
        return F.conv2d(x, weight, bias, *args, groups=x.shape[1])
    return _dw_op(x, weight, bias, *args)


class DepthwiseConv2d(nn.Module):
    """Depthwise conv module: (N, C, H, W) -> (N, C, Ho, Wo), weight (C, 1, kh, kw), like
    ``nn.Conv2d(C, C, k, groups=C)`` (same initialisation) but running ``compress::depthwise_conv2d``."""

    def __init__(self, channels: int, kernel_size, stride=1, padding=0, dilation=1, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        ref = nn.Conv2d(channels, channels, kernel_size, stride, padding, dilation, groups=channels, bias=bias,
                        device=device, dtype=dtype)
        self.channels = channels
        self.kernel_size, self.stride = ref.kernel_size, ref.stride
        self.padding, self.dilation = ref.padding, ref.dilation
        self.weight = ref.weight
        self.bias = ref.bias

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> DepthwiseConv2d:
        if (conv.groups != conv.in_channels or conv.out_channels != conv.in_channels or isinstance(conv.padding, str)
                or conv.padding_mode != "zeros"):
            raise ValueError("DepthwiseConv2d.from_conv needs a conv with groups == in == out channels and numeric "
                             f"zero padding, got groups={conv.groups}, {conv.in_channels} -> {conv.out_channels} "
                             f"channels, padding={conv.padding!r}, padding_mode={conv.padding_mode!r}")
        m = cls(conv.in_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.bias is not None)
        m.weight, m.bias = conv.weight, conv.bias
        return m

    def forward(self, x: Tensor) -> Tensor:
        return depthwise_conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, bias={self.bias is not None}")
