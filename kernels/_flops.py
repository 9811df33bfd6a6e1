"""FLOP formulas of the compress ops for ``torch.utils.flop_counter.FlopCounterMode``, in its convention: 2 per
multiply-add of the products only (bias adds, pooling, sigmoid and PiX's pick or mix count nothing, as for aten's
ops). Without them the counter saw 0 FLOPs in a stripe-mode layer, a PiX block or the custom convs (it does not
look inside a custom op). ``compress.profile`` counts every op's real work (MACs, memory) instead."""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

import kernels.conv2d  # noqa: F401 - registers the ops the formulas name
import kernels.depthwise  # noqa: F401
import kernels.pix  # noqa: F401
import kernels.stripe  # noqa: F401

_ops = torch.ops.compress


def _stripe_flops(x_shape, weight_shape, out_shape) -> int:
    """2 * (output pixels) * (kept stripes) * C: each kept stripe is a C-long dot product per output pixel."""
    batch, _, ho, wo = out_shape
    return 2 * batch * ho * wo * weight_shape[0] * x_shape[1]


@register_flop_formula(_ops.stripe_conv2d)
def _stripe_forward(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _stripe_flops(x_shape, weight_shape, out_shape)


@register_flop_formula(_ops.stripe_conv2d_backward)
def _stripe_backward(grad_shape, x_shape, weight_shape, out_index, offset, plan, out_channels, kernel_size, stride,
                     padding, dilation, need_x, need_w, *args, out_shape=None, **kwargs) -> int:
    return (bool(need_x) + bool(need_w)) * _stripe_flops(x_shape, weight_shape, grad_shape)


@register_flop_formula([_ops.conv2d, _ops.depthwise_conv2d])
def _conv_forward(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(x_shape, weight_shape, out_shape)


@register_flop_formula([_ops.conv2d_backward, _ops.depthwise_conv2d_backward])
def _conv_backward(grad_shape, x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * conv_flop_count(x_shape, weight_shape, grad_shape)  # grad_x and grad_weight, each the forward's


@register_flop_formula(_ops.pix_squeeze)
def _pix_squeeze_forward(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * math.prod(weight_shape)  # the predictor: (B, C) @ (C, C / zeta)


@register_flop_formula(_ops.pix_squeeze_backward)
def _pix_squeeze_backward(grad_shape, x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 4 * x_shape[0] * math.prod(weight_shape)  # the predictor's input and weight gradients
