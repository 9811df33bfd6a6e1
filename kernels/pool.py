"""Max-pool with a fast CPU path for contiguous NCHW inference: ``max_pool2d``.

PyTorch's CPU max-pool is slow on contiguous NCHW input. On the project's 2-core Intel Xeon host (2 threads)
ResNet-50's stem pool, (1, 64, 112, 112) 3x3 stride 2, took 4.4 ms NCHW against 0.48 ms for the same tensor
channels_last: about 5% of a batch-1 ResNet-50 forward, in the dense model and in every compact or PiX model
built from it, and a CIFAR VGG's five pools likewise. Here a C++ kernel (``kernels/_cpu.py``,
``max_pool2d_nchw_*``) reduces each output row's window rows into one row with a vectorised elementwise max,
then takes each output's columns of it: 0.57 ms there, 1.4-10x PyTorch's NCHW pool on ResNet's and VGG's pools
(``benchmarks/max_pool_cpu.py`` -> ``benchmarks/results/max_pool_cpu_session31.json``).

Why not a registered op: this is an eager-inference shortcut to ``aten::max_pool2d``, value for value (the max is
exact; a NaN in a window gives NaN, as PyTorch's; only the sign bit of a tie between 0.0 and -0.0, or between NaNs,
may differ, since the window is reduced by rows then columns). Every other call runs ``F.max_pool2d`` itself:
autograd recording (forward-mode AD too), TorchScript tracing, torch.compile, ONNX and torch.func see the aten
op, and so do other devices, dtypes (half precision), layouts (channels_last, whose aten kernel is already fast;
mkldnn) and arguments F.max_pool2d itself refuses (it raises its own error).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _cpu
from kernels._utils import conv_out_size, plain_eager, recording

__all__ = ["max_pool2d", "max_pool2x2"]

_DTYPES = {torch.float32: "f32", torch.float64: "f64"}


def _out_size(size: int, k: int, pad: int, stride: int, dilation: int, ceil_mode: bool) -> int:
    """PyTorch's pooled output length (``pooling_output_shape``): the conv's, rounded up in ceil mode, where the last
    window starts inside the input or its left padding."""
    if not ceil_mode:
        return conv_out_size(size, k, stride, pad, dilation)
    out = conv_out_size(size + stride - 1, k, stride, pad, dilation)
    return out - 1 if (out - 1) * stride >= size + pad else out


def _ints(v) -> list[int] | None:
    """[a, b] for an int or a sequence of one or two ints (what F.max_pool2d accepts), each below 2**31; else None
    (bools, tensors, floats and huge values go to F.max_pool2d, which raises or converts them itself)."""
    if type(v) is int:
        v = [v]
    if not isinstance(v, (list, tuple)) or len(v) not in (1, 2) or any(type(a) is not int for a in v):
        return None
    if any(abs(a) >= 2**31 for a in v):
        return None
    return [v[0], v[-1]]


def _c_shape(x: torch.Tensor, kernel_size, stride, padding, dilation, ceil_mode) -> list[int] | None:
    """[OH, OW, kh, kw, sh, sw, ph, pw, dh, dw] where the C++ kernel computes this call exactly as F.max_pool2d
    would; None where F.max_pool2d must run (other input, or arguments it rejects with its own error)."""
    if not (x.device.type == "cpu" and x.dtype in _DTYPES and x.layout == torch.strided and x.dim() in (3, 4)
            and x.numel() > 0 and x.is_contiguous()
            and not (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))):
        return None
    k = _ints(kernel_size)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else _ints(stride)
    p, d = _ints(padding), _ints(dilation)
    if k is None or s is None or p is None or d is None or type(ceil_mode) is not bool:
        return None
    out = []
    for size, kn, pn, sn, dn in zip(x.shape[-2:], k, p, s, d):
        if min(kn, sn, dn) < 1 or not 0 <= pn <= kn // 2:  # F.max_pool2d's own checks (padding: of the undilated
            return None                                   # kernel)
        out.append(_out_size(size, kn, pn, sn, dn, ceil_mode))
    if min(out) < 1:
        return None
    return [*out, *k, *s, *p, *d]


def max_pool2d(x: torch.Tensor, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode: bool = False) -> torch.Tensor:
    """``F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)`` (no indices), x (B, C, H, W) ->
    (B, C, OH, OW), or (C, H, W) -> (C, OH, OW). In plain eager inference on a CPU float32/float64 contiguous NCHW x (autograd not
    recording x) the C++ kernel computes it, multi-threaded over the B*C planes on torch's threads; everything else
    is F.max_pool2d."""
    shape = None
    if isinstance(x, torch.Tensor) and not recording(x) and plain_eager(x):
        shape = _c_shape(x, kernel_size, stride, padding, dilation, ceil_mode)
    lib = _cpu.lib() if shape is not None else None
    if lib is None:
        return F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode)
    H, W = x.shape[-2:]
    y = x.new_empty((*x.shape[:-2], shape[0], shape[1]))
    planes, stack = x.numel() // (H * W), _stacked_planes(x, shape)
    args = (planes // stack, H * stack, W, shape[0] * stack, *shape[1:])
    fn = getattr(lib, f"max_pool2d_nchw_{_DTYPES[x.dtype]}")
    if fn(x.data_ptr(), y.data_ptr(), *args):
        raise MemoryError("kernels.max_pool2d: out of memory in the CPU kernel")
    return y


def _stacked_planes(x: torch.Tensor, shape: list[int]) -> int:
    """How many consecutive planes the kernel may take as one tall plane: where the windows tile each plane exactly
    (kernel = stride vertically, no padding or dilation, H = OH * stride), a window never spans two planes, so
    small maps (VGG's 8x8 and 4x4 pools: one short row loop per plane otherwise) are pooled in stacks of about 4096
    values, a divisor of the plane count; else 1."""
    H, W = x.shape[-2:]
    OH, kh, sh, ph, dh = shape[0], shape[2], shape[4], shape[6], shape[8]
    if not (kh == sh and ph == 0 and dh == 1 and H == OH * sh) or H * W >= 4096:
        return 1
    planes = x.numel() // (H * W)
    want = min(planes, 4096 // (H * W))
    return next(d for d in range(want, 0, -1) if planes % d == 0)  # the largest divisor up to `want`


def max_pool2x2(y: torch.Tensor, ceil_mode: bool) -> torch.Tensor:
    """The 2x2, stride-2 max-pool a pooling stripe conv applies after its ReLU (`StripeConv2d.pool`)."""
    return max_pool2d(y, 2, ceil_mode=ceil_mode)
