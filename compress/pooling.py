"""MaxPool2d: nn.MaxPool2d with a fast CPU inference path, and `fast_max_pools`, which puts it in a model.

PyTorch's CPU max-pool is 8-10x slower on contiguous NCHW input than channels_last (ResNet-50's stem pool: 4.4
against 0.48 ms on the project's 2-core Intel host); `kernels.max_pool2d` computes the same values in a C++
kernel in plain eager CPU inference and calls F.max_pool2d everywhere else (autograd, tracing, torch.compile, ONNX,
GPUs, half precision, channels_last). Compaction with `fuse_relu=True` (export's inference layout) swaps every
nn.MaxPool2d for this one, in the compact model and in the dense baseline export compares it with.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import kernels
from compress.surgery import replace_module

__all__ = ["MaxPool2d", "fast_max_pools"]


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (no indices) whose forward is `kernels.max_pool2d`: the same values, with the C++ kernel for
    CPU float32/float64 NCHW input in eager inference. Same arguments and (empty) state dict as nn.MaxPool2d."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False):
        super().__init__(kernel_size, stride, padding, dilation, return_indices=False, ceil_mode=ceil_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode)

    def config(self) -> dict:
        """Constructor arguments (JSON: a tuple is kept as a list), for compact model files."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in (
            ("kernel_size", self.kernel_size), ("stride", self.stride), ("padding", self.padding),
            ("dilation", self.dilation), ("ceil_mode", self.ceil_mode))}


def fast_max_pools(model: nn.Module) -> list[str]:
    """Replace, in place, each module of `model` that is exactly an nn.MaxPool2d without return_indices by a
    MaxPool2d with the same arguments. Returns the replaced modules' names."""
    names = [n for n, m in model.named_modules() if type(m) is nn.MaxPool2d and not m.return_indices]
    for name in names:
        old = model.get_submodule(name)
        new = MaxPool2d(old.kernel_size, old.stride, old.padding, old.dilation, old.ceil_mode)
        replace_module(model, name, new.train(old.training))
    return names
