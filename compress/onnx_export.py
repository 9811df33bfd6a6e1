"""ONNX export of compact models with standard ops only, checked against PyTorch in onnxruntime.

    export_onnx(model, "model.onnx", input_size=(3, 32, 32))   # stripe convs as dense convs
    export_onnx(model, "model.onnx", (3, 32, 32), stripe_mode="shift")
    check_onnx("model.onnx", model, torch.randn(2, 3, 32, 32))  # max relative error

Each StripeConv2d is exported as either
- "dense" (default): an ONNX Conv with the dropped stripes as zeros; exact, and the fastest in
  runtimes without a sparse kernel, but it does the dense conv's work;
- "shift": one 1x1 Conv over all kept stripes on the zero-padded input, then per (kh, kw) offset a
  strided Slice of its stripes, a Gather that places them in their output channels (a zero channel
  where a filter has no stripe at that offset) and an Add: Conv/Pad/Slice/Concat/Gather/Add only.
The batch dimension is dynamic; the spatial size is fixed to `input_size`.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from compress.stripe import StripeConv2d
from kernels._utils import max_pool2x2

__all__ = ["ShiftAddConv2d", "onnx_ready", "export_onnx", "check_onnx", "STRIPE_MODES"]

STRIPE_MODES = ("dense", "shift")
CENTRED_FLOOR = 1e-3  # check_onnx: the smallest scale of the batch-centred outputs, relative to the outputs


class ShiftAddConv2d(nn.Module):
    """A StripeConv2d as a 1x1 conv plus shifted adds: x (B, C, H, W) -> (B, N, Ho, Wo) (pooled if the stripe conv
    pools), same output."""

    def __init__(self, stripe: StripeConv2d):
        super().__init__()
        self.stride, self.padding, self.dilation = stripe.stride, stripe.padding, stripe.dilation
        self.kernel_size, self.out_channels, self.relu = stripe.kernel_size, stripe.out_channels, stripe.relu
        self.pool, self.pool_ceil = stripe.pool, stripe.pool_ceil
        self.weight = nn.Parameter(stripe.weight.detach().clone()[:, :, None, None])  # (S, C, 1, 1)
        self.bias = None if stripe.bias is None else nn.Parameter(stripe.bias.detach().clone())
        # per offset: (kh, kw, first stripe, last stripe + 1, gather index (N,) into [its stripes, zero])
        self.groups: list[tuple[int, int, int, int]] = []
        s = stripe.num_stripes
        offsets = stripe.offset.tolist()
        start = 0
        for k in range(1, s + 1):
            if k == s or offsets[k] != offsets[start]:
                gather = torch.full((stripe.out_channels,), k - start, dtype=torch.long)
                gather[stripe.out_index[start:k]] = torch.arange(k - start)
                self.register_buffer(f"gather{len(self.groups)}", gather)
                self.groups.append((*offsets[start], start, k))
                start = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ph, pw = self.padding
        z = F.conv2d(F.pad(x, (pw, pw, ph, ph)), self.weight)  # (B, S, H + 2ph, W + 2pw)
        ho = (x.shape[2] + 2 * ph - self.dilation[0] * (self.kernel_size[0] - 1) - 1) // self.stride[0] + 1
        wo = (x.shape[3] + 2 * pw - self.dilation[1] * (self.kernel_size[1] - 1) - 1) // self.stride[1] + 1
        y = x.new_zeros(x.shape[0], self.out_channels, ho, wo)
        for g, (i, j, lo, hi) in enumerate(self.groups):
            r, c = i * self.dilation[0], j * self.dilation[1]
            part = z[:, lo:hi, r : r + self.stride[0] * (ho - 1) + 1 : self.stride[0],
                     c : c + self.stride[1] * (wo - 1) + 1 : self.stride[1]]
            part = torch.cat([part, part.new_zeros(part.shape[0], 1, ho, wo)], dim=1)
            y = y + part.index_select(1, getattr(self, f"gather{g}"))
        y = y if self.bias is None else y + self.bias[:, None, None]
        y = y.relu() if self.relu else y
        return max_pool2x2(y, self.pool_ceil) if self.pool else y


def onnx_ready(model: nn.Module, stripe_mode: str = "dense") -> nn.Module:
    """A copy of `model` in eval mode with every StripeConv2d replaced by standard-op modules."""
    if stripe_mode not in STRIPE_MODES:
        raise ValueError(f"stripe_mode must be one of {STRIPE_MODES}, got {stripe_mode!r}")
    ready = copy.deepcopy(model).eval()
    stripes = [(n, m) for n, m in ready.named_modules() if isinstance(m, StripeConv2d)]
    for name, m in stripes:
        new = m.to_dense() if stripe_mode == "dense" or m.num_stripes == 0 else ShiftAddConv2d(m)
        parent, _, child = name.rpartition(".")
        setattr(ready.get_submodule(parent), child, new.eval())
    return ready


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    input_size: Sequence[int],
    stripe_mode: str = "dense",
    opset: int = 17,
) -> Path:
    """Write `model` as ONNX (input "input" (B, C, H, W), output "output"; B dynamic) and check it
    with onnx.checker. Returns the path."""
    import onnx

    ready = onnx_ready(model, stripe_mode)
    param = next(ready.parameters())
    x = torch.randn(1, *input_size, device=param.device, dtype=param.dtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # strided slices (e.g. option-A shortcuts) are exported fine, only not constant-folded
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
        torch.onnx.export(
            ready,
            (x,),
            str(path),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            opset_version=opset,
            dynamo=False,
        )
    onnx.checker.check_model(str(path), full_check=True)
    return path


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def check_onnx(path: str | os.PathLike, model: nn.Module, x: torch.Tensor) -> float:
    """Relative error of onnxruntime's output for `x` (batch >= 2) against `model(x)` in eval mode (CPU).

    The larger of max|ort - torch| / max|torch| and the same for the batch-centred outputs
    (output minus its batch mean), so that large constant outputs (biases) cannot hide errors in
    the input-dependent part. The centred part is measured against at least 1e-3 max|torch|: an output that
    hardly depends on the input (a randomly initialised model: its batch spread can be 1e-7 of the output) would
    otherwise turn float32 rounding into errors near 1."""
    import onnxruntime as ort

    if x.shape[0] < 2:
        raise ValueError(f"check_onnx: needs a batch of >= 2 inputs to compare centred outputs, got {x.shape[0]}")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": x.detach().cpu().float().numpy()})
    got = torch.from_numpy(got)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(x).float().cpu()
    finally:
        model.train(was_training)
    centred = (got - got.mean(0) - (want - want.mean(0))).abs().max()
    scale = torch.maximum((want - want.mean(0)).abs().max(), CENTRED_FLOOR * want.abs().max()).clamp_min(1e-12)
    return max(_rel_error(got, want), float(centred / scale))
