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
The batch dimension is dynamic; the spatial size is fixed to `input_size`. An adaptive average pool whose
output size does not divide its input size (torchvision's and timm's VGGs below 224x224: 7x7 from 1x1 .. 6x6)
has no ONNX counterpart in PyTorch's exporter; at the traced size it is a fixed linear map, exported as one
MatMul (`FixedAdaptiveAvgPool2d`; put before timm's VGG head, which pools inside its forward).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from compress._modes import evaluating
from compress.stripe import StripeConv2d
from compress.surgery import copy_model, imported_classes, refresh_weight, replace_module
from kernels.pool import max_pool2x2

__all__ = ["ShiftAddConv2d", "FixedAdaptiveAvgPool2d", "onnx_ready", "export_onnx", "check_onnx", "STRIPE_MODES"]

STRIPE_MODES = ("dense", "shift")
# check_onnx: the smallest scale of the batch-centred outputs, relative to the outputs. 1e-3 read float32 rounding
# as 1-3e-4 errors on deep randomly initialised timm nets (EfficientNet-B0, Inception-v4, Xception-41: their batch
# spread is at or below 1e-3 of the output, and the float32 PyTorch model is that far from float64 too)
CENTRED_FLOOR = 1e-2
FLAT_OUTPUT = 1e-6  # check_onnx warns below this batch spread of the outputs (relative to their size)


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


class FixedAdaptiveAvgPool2d(nn.Module):
    """`nn.AdaptiveAvgPool2d(out_size)` for one input size: x (B, C, H, W) -> (B, C, Ho, Wo) as x.flatten(2) @ P.T,
    P (Ho*Wo, H*W) holding 1/window size where output cell (i, j) averages input pixel (h, w) (PyTorch's
    windows: rows floor(i*H/Ho) .. ceil((i+1)*H/Ho) - 1, columns likewise)."""

    def __init__(self, in_size: tuple[int, int], out_size: tuple[int, int]):
        super().__init__()
        (h, w), (ho, wo) = in_size, out_size
        self.in_size, self.out_size = (h, w), (ho, wo)
        rows = self._windows(h, ho)  # (Ho, H)
        cols = self._windows(w, wo)  # (Wo, W)
        pool = rows[:, None, :, None] * cols[None, :, None, :]  # (Ho, Wo, H, W)
        self.register_buffer("pool", pool.reshape(ho * wo, h * w))  # float64; cast to the input's dtype

    @staticmethod
    def _windows(n: int, out: int) -> torch.Tensor:
        """(out, n): row i averages inputs floor(i*n/out) .. ceil((i+1)*n/out) - 1."""
        weights = torch.zeros(out, n, dtype=torch.float64)
        for i in range(out):
            lo, hi = (i * n) // out, -(-((i + 1) * n) // out)
            weights[i, lo:hi] = 1.0 / (hi - lo)
        return weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_tracing() and tuple(x.shape[2:]) != self.in_size:
            raise ValueError(f"FixedAdaptiveAvgPool2d was built for {self.in_size} inputs, got {tuple(x.shape[2:])}")
        y = x.flatten(2) @ self.pool.to(x.dtype).t()  # (B, C, Ho*Wo)
        return y.unflatten(2, self.out_size)


def onnx_ready(model: nn.Module, stripe_mode: str = "dense", example: torch.Tensor | None = None) -> nn.Module:
    """A copy of `model` in eval mode with every StripeConv2d replaced by standard-op modules, and, given an
    `example` input, every adaptive average pool whose output size does not divide its input size there by a
    `FixedAdaptiveAvgPool2d` (exact at that input size only)."""
    if stripe_mode not in STRIPE_MODES:
        raise ValueError(f"stripe_mode must be one of {STRIPE_MODES}, got {stripe_mode!r}")
    ready = copy_model(model).eval()
    stripes = [(n, m) for n, m in ready.named_modules() if isinstance(m, StripeConv2d)]
    for name, m in stripes:
        refresh_weight(m)  # (a weight torch's prune or weight norm computes: as of now, not of the last forward)
        new = m.to_dense() if stripe_mode == "dense" or m.num_stripes == 0 else ShiftAddConv2d(m)
        replace_module(ready, name, new.eval())
    if example is not None:
        for name, in_size, out_size in _uneven_adaptive_pools(ready, example):
            pool = FixedAdaptiveAvgPool2d(in_size, out_size).to(example.device)
            module = ready.get_submodule(name)
            # a timm ConvMlp pools inside its forward: the fixed pool goes before it (it then sees its kernel size)
            replace_module(ready, name, pool if isinstance(module, nn.AdaptiveAvgPool2d) else nn.Sequential(pool, module))
    return ready


def _uneven_adaptive_pools(model: nn.Module, example: torch.Tensor) -> list[tuple[str, tuple, tuple]]:
    """(name, input (H, W), output (Ho, Wo)) of each adaptive average pool whose output size does not divide its
    input size when `model` runs on `example`: nn.AdaptiveAvgPool2d modules, and timm's VGG head (`ConvMlp`),
    which calls F.adaptive_avg_pool2d up to its kernel size on inputs smaller than that (VGGs below 224x224)."""
    found, hooks = [], []
    conv_mlp = imported_classes("timm.models.vgg", "ConvMlp")
    for name, m in model.named_modules():
        if isinstance(m, nn.AdaptiveAvgPool2d):
            def record(mod, args, out, name=name):
                (h, w), (ho, wo) = args[0].shape[2:], out.shape[2:]
                if h % ho or w % wo:
                    found.append((name, (h, w), (ho, wo)))
            hooks.append(m.register_forward_hook(record))
        elif isinstance(m, conv_mlp):
            def record_mlp(mod, args, name=name):
                (h, w), k = args[0].shape[2:], mod.input_kernel_size
                if h < k or w < k:
                    found.append((name, (h, w), (max(k, h), max(k, w))))
            hooks.append(m.register_forward_pre_hook(record_mlp))
    try:
        with torch.no_grad():
            model(example)
    finally:
        for hook in hooks:
            hook.remove()
    return found


MIN_OPSET = 13  # PiX's group split (unflatten) needs it


def check_opset(opset, where: str = "export_onnx: opset") -> None:
    """ValueError unless `opset` is an int from MIN_OPSET to the newest opset this torch.onnx writes (23 in torch
    2.14; 13-23 export and match onnxruntime, from 21 with a warning from torch.onnx's TorchScript exporter)."""
    newest = torch.onnx._constants.ONNX_MAX_OPSET  # (private: torch.onnx has no public name for it)
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= newest:
        raise ValueError(f"{where}={opset!r}; use an opset from {MIN_OPSET} to {newest} (the default is 17)")


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    input_size: Sequence[int],
    stripe_mode: str = "dense",
    opset: int = 17,
) -> Path:
    """Write `model` as ONNX (input "input" (B, C, H, W), output "output"; B dynamic) and check it
    with onnx.checker. `input_size`: (C, H, W) of one image. A model returning a tuple, list or dict of tensors gets
    one output per tensor, in `output_tensors` order: "output", "output1", ... Returns the path."""
    import onnx

    check_opset(opset)
    if (isinstance(input_size, (str, bytes)) or not isinstance(input_size, Sequence) or len(input_size) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in input_size)):
        raise ValueError(f"export_onnx: input_size must be (C, H, W) of one image, three positive ints; got "
                         f"{input_size!r}")
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError(f"export_onnx: the model ({type(model).__name__}) has no parameters; ONNX export here is "
                         "for compact models (their dtype and device come from the parameters)")
    if param.dtype in (torch.float64, torch.bfloat16):  # (ONNX's Conv has no bfloat16; onnxruntime's CPU no float64)
        raise ValueError(f"export_onnx: the model is {str(param.dtype).removeprefix('torch.')}, which ONNX "
                         "convolutions in onnxruntime do not run; export a float32 copy (copy.deepcopy(model).float())")
    no_stats = [name for name, m in model.named_modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.track_running_stats]
    if no_stats:  # (torch.onnx would fail an assert in its symbolic, after printing the whole graph)
        raise ValueError(f"export_onnx: {', '.join(no_stats[:3])}: a BatchNorm without running statistics "
                         "(track_running_stats=False) normalises with each batch's own, which ONNX inference cannot "
                         "express; export without ONNX (export.py onnx.enabled=false)")
    x = torch.randn(1, *input_size, device=param.device, dtype=param.dtype)
    ready = onnx_ready(model, stripe_mode, example=x)
    with torch.no_grad():
        outputs = len(output_tensors(ready(x), "export_onnx"))
    names = ["output"] + [f"output{i}" for i in range(1, outputs)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # strided slices (e.g. option-A shortcuts) are exported fine, only not constant-folded
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1")
        try:
            torch.onnx.export(
                ready,
                (x,),
                str(path),
                input_names=["input"],
                output_names=names,
                dynamic_axes={name: {0: "batch"} for name in ["input", *names]},
                opset_version=opset,
                dynamo=False,
            )
        except (torch.onnx.OnnxExporterError, AssertionError) as err:  # what torch.onnx cannot express (not ours; a
            # BN without running statistics fails an assert in its symbolic)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"export_onnx: torch.onnx cannot export this model at input size {tuple(input_size)} (opset {opset}): "
                f"{first}. The model itself is fine: export without ONNX (export.py onnx.enabled=false), or try "
                "another onnx.opset or input size"
            ) from err
    onnx.checker.check_model(str(path), full_check=True)
    return path


def output_tensors(out, where: str) -> list[torch.Tensor]:
    """The tensors of a model's output `out`: itself, or the leaves of a tuple, list or dict of them (nested, in
    order), as torch.onnx flattens them into outputs. ValueError naming `where` for anything else (a dataclass, a
    number), which torch.onnx cannot export."""
    from torch.utils._pytree import tree_leaves

    container = isinstance(out, (tuple, list, dict))
    leaves = tree_leaves(out) if container else [out]
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        held = sorted({type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor)})
        raise ValueError(f"{where}: the model returns {type(out).__name__}"
                         f"{' holding ' + ', '.join(held) if container and held else ''}{' (empty)' if not leaves else ''}; "
                         "ONNX export takes a tensor, or a tuple, list or dict of tensors: wrap the model in a module "
                         "whose forward returns those (or export without ONNX: export.py onnx.enabled=false)")
    return leaves


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def check_onnx(path: str | os.PathLike, model: nn.Module, x: torch.Tensor) -> float:
    """Relative error of onnxruntime's output for `x` (batch >= 2) against `model(x)` in eval mode (CPU); for a model
    returning several tensors (`output_tensors`), the largest over its outputs.

    The larger of max|ort - torch| / max|torch| and the same for the batch-centred outputs
    (output minus its batch mean), so that large constant outputs (biases) cannot hide errors in
    the input-dependent part. The centred part is measured against at least 1e-2 max|torch|: an output that
    hardly depends on the input (a randomly initialised model: its batch spread can be 1e-7 of the output) would
    otherwise turn float32 rounding into errors near 1."""
    import onnxruntime as ort

    if x.shape[0] < 2:
        raise ValueError(f"check_onnx: needs a batch of >= 2 inputs to compare centred outputs, got {x.shape[0]}")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    dtype = {"tensor(float16)": torch.float16}.get(session.get_inputs()[0].type, torch.float32)  # the graph's
    gots = [torch.from_numpy(g).float() for g in session.run(None, {"input": x.detach().cpu().to(dtype).numpy()})]
    weights = next((t.dtype for t in model.parameters() if t.is_floating_point()), x.dtype)
    with evaluating(model), torch.no_grad():  # (in the model's dtype: a float16 model took float32 x)
        wants = [t.float().cpu() for t in output_tensors(model(x.to(weights)), "check_onnx")]
    if len(gots) != len(wants):
        raise ValueError(f"check_onnx: {path} has {len(gots)} outputs and the model returns {len(wants)} tensors; "
                         "check the ONNX file of this model (compress.onnx_export.export_onnx writes one per tensor)")
    return max(_output_error(got, want, model, x.shape[0], f"output {i}" if len(wants) > 1 else "output")
               for i, (got, want) in enumerate(zip(gots, wants)))


def _output_error(got: torch.Tensor, want: torch.Tensor, model: nn.Module, batch: int, which: str) -> float:
    """`check_onnx`'s measure for one output: onnxruntime's `got` against PyTorch's `want` (batch first; an output
    without the batch dimension, a scalar, is compared as it is)."""
    if want.dim() == 0 or want.shape[0] != batch:
        return _rel_error(got, want)
    spread = (want - want.mean(0)).abs().max()
    if want.isfinite().all() and not spread > FLAT_OUTPUT * want.abs().max():
        empty = [n for n, m in model.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes == 0]
        why = (f"; its stripe convs {', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''} kept no stripe (their "
               "output is their bias alone, whatever the input): a lower threshold or a larger target_macs keeps "
               "some" if empty else " (an untrained model?)")
        warnings.warn(f"check_onnx: the model gives (nearly) the same {which} for each of the {batch} check inputs "
                      f"(batch spread {float(spread):.1e} against outputs up to {float(want.abs().max()):.1e}), so the "
                      f"check compares little more than its biases; check the model's weights{why}", stacklevel=3)
    centred = (got - got.mean(0) - (want - want.mean(0))).abs().max()
    scale = torch.maximum(spread, CENTRED_FLOOR * want.abs().max()).clamp_min(1e-12)
    return max(_rel_error(got, want), float(centred / scale))
