"""Custom ops for the compression framework, registered with ``torch.library`` in the ``compress`` namespace.

Public functions (thin wrappers over ``torch.ops.compress.*``) and modules:
    pix(x, p, zeta, tau=0.5), pix_squeeze(x, weight, zeta, tau=0.5) (the whole PiX block),
    residual_relu(out, identity) (a residual tail that hands the next PiX block its pool; eager CUDA fast path)
    depthwise_conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1), DepthwiseConv2d
    conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1), Im2colConv2d
    stripe_conv2d(...) and its helpers; prepare_stripe_conv2d(...) (an eager inference launcher without dispatch)
    max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False): F.max_pool2d with a C++ path
    for CPU NCHW eager inference (not a registered op: ``kernels/pool.py`` says why)
Each op has a CPU path (vectorised PyTorch; C++ for PiX, the PiX block and the NCHW max-pool), a CUDA path
(``csrc/``, compiled on first use, see ``_ext``), a fake kernel and autograd (the backward is its own op).
``python -m kernels build`` prebuilds the extension.

``kernels.pix`` and ``kernels.conv2d`` are the functions, which hide their modules as attributes (``import
kernels.pix as kp`` binds the function); ``from kernels.pix import pix_squeeze_ops`` reaches a module's other names.
"""

import kernels._flops  # noqa: F401 - FlopCounterMode formulas of the ops (it imports their modules)
from kernels.conv2d import Im2colConv2d, conv2d
from kernels.depthwise import DepthwiseConv2d, depthwise_conv2d
from kernels.pix import pix, pix_reference, pix_squeeze, residual_relu
from kernels.pool import max_pool2d
from kernels.stripe import (
    dense_trim,
    prepare_stripe_conv2d,
    stripe_conv2d,
    stripe_cost,
    stripe_plan,
    stripe_reads_dense,
    stripe_route,
    stripe_rows,
    stripe_tile_keep,
    stripe_to_dense,
    trimmed_dense,
)

__all__ = ["pix", "pix_squeeze", "pix_reference", "residual_relu", "depthwise_conv2d", "DepthwiseConv2d", "conv2d", "Im2colConv2d",
           "stripe_conv2d", "prepare_stripe_conv2d", "stripe_plan", "stripe_to_dense", "stripe_rows", "stripe_tile_keep", "stripe_reads_dense", "stripe_route",
           "stripe_cost", "dense_trim", "trimmed_dense", "max_pool2d"]
