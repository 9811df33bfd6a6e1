"""Shared argument checks and layout helpers for the ``compress::`` ops."""

from __future__ import annotations

import decimal
import numbers
import operator
from collections.abc import Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def whole(v, name: str) -> int:
    """``v`` as an int: any integer (a NumPy one too), never a float or a bool, which ``int()`` would truncate or
    take as 1 without a word (``zeta=3.7`` ran as 3). TypeError naming ``name`` otherwise."""
    if not isinstance(v, bool):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {v!r}")


def check_tau(where: str, tau, key: str = "tau") -> float:
    """``tau`` as a float; ValueError naming ``where`` and ``key`` (the argument, or pix.tau in a config) unless it is
    a number in [0, 1] (NaN would take the mean everywhere without a word)."""
    # p = sigmoid(...) lies in [0, 1] once rounded: tau 0 always mixes; tau 1 picks unless p rounds to 1
    number = (isinstance(tau, (numbers.Real, decimal.Decimal)) and not isinstance(tau, bool)) or (
        isinstance(tau, torch.Tensor) and tau.numel() == 1 and tau.dtype != torch.bool and not tau.is_complex())
    if not number or not 0.0 <= float(tau) <= 1.0:
        shown = "null" if tau is None else repr(tau)
        raise ValueError(f"{where}: {key}={shown} must be a number in [0, 1] (pix.tau; the paper uses 0.5)")
    return float(tau)


def pair(v, name: str = "value") -> list[int]:
    if type(v) is int:  # the common cases first: every eager layer call passes here
        return [v, v]
    if type(v) in (tuple, list) and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        return [v[0], v[1]]
    if isinstance(v, str):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}: string padding ('same', 'valid') is not "
                         "supported; give the padding in pixels")
    try:
        v = [whole(a, name) for a in v] if hasattr(v, "__iter__") else [whole(v, name)] * 2
    except TypeError:
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}") from None
    if len(v) == 1:
        return [v[0], v[0]]
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {v}")
    return v


def is_channels_last(x: torch.Tensor) -> bool:
    """True when x is stored channels_last and not also plain contiguous (ambiguous shapes count as NCHW)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def memory_format(x: torch.Tensor) -> torch.memory_format:
    """The layout the ops produce for an input ``x``: channels_last if ``x`` is, else contiguous NCHW."""
    return torch.channels_last if is_channels_last(x) else torch.contiguous_format


def check_4d(op: str, name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: '{name}' must be a Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{op}: tensor '{name}' must be a dense (strided) tensor, got layout {t.layout}")
    if t.dim() != 4:
        raise ValueError(f"{op}: tensor '{name}' must be 4-D (N, C, H, W), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: tensor '{name}' has dtype {t.dtype}; supported: {', '.join(map(str, dtypes))}")


def check_like(op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str = "x") -> None:
    if t.layout != torch.strided:
        raise ValueError(f"{op}: tensor '{name}' must be a dense (strided) tensor, got layout {t.layout}")
    if t.device != ref.device:
        raise ValueError(f"{op}: tensor '{name}' is on {t.device} but '{ref_name}' is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: tensor '{name}' has dtype {t.dtype} but '{ref_name}' has dtype {ref.dtype}")


def conv_out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def check_conv_params(op: str, stride, padding, dilation) -> None:
    for nm, v, lo in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if len(v) != 2 or any(int(a) < lo for a in v):
            raise ValueError(f"{op}: {nm} must be two ints >= {lo}, got {list(v)}")


def check_conv_output(op: str, x: torch.Tensor, kernel_size, stride, padding, dilation) -> tuple[int, int]:
    """(Ho, Wo) of a conv of x (N, C, H, W) with a (kh, kw) kernel; a clear error for an empty kernel or an input too
    small for it."""
    (H, W), (kh, kw) = x.shape[2:], tuple(kernel_size)
    if kh < 1 or kw < 1:
        raise ValueError(f"{op}: the kernel {(kh, kw)} is empty (the weight's last two sizes); a conv needs "
                         "kh, kw >= 1")
    ho = conv_out_size(H, kh, stride[0], padding[0], dilation[0])
    wo = conv_out_size(W, kw, stride[1], padding[1], dilation[1])
    if ho < 1 or wo < 1:
        raise ValueError(f"{op}: tensor 'x' of spatial size {(H, W)} is too small for kernel {(kh, kw)} "
                         f"with padding {list(padding)} and dilation {list(dilation)}")
    return ho, wo


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


INDEX_LIMIT = 2**31 - 2**24  # elements: 32-bit index math, less a grid-stride loop's last step past its end


def use_kernel(t: torch.Tensor, out_elements: int = 0) -> bool:
    """Whether CUDA work on `t` goes to the compiled kernels; else the PyTorch path: float64; `t` or the call's
    output (`out_elements`) of ``INDEX_LIMIT`` or more elements (the kernels index in 32 bits, and a grid-stride
    loop steps up to its stride, about a million, past its end before its check); a batch or channel count above
    65535 (kernels put them in the CUDA grid's y or z)."""
    return (t.dtype in KERNEL_DTYPES and max(t.numel(), out_elements) < INDEX_LIMIT
            and (t.dim() < 2 or max(t.shape[0], t.shape[1]) <= 65535))


def conv_tf32(cudnn=torch.backends.cudnn) -> bool:
    """Whether float32 convs may multiply in TF32, as the user set it in `cudnn` (PyTorch's settings module):
    ``conv.fp32_precision`` ("tf32" or "ieee"; once that API is used, reading the older ``allow_tf32`` raises), else
    (its "none", or an older PyTorch) ``allow_tf32``, PyTorch's default True."""
    precision = getattr(getattr(cudnn, "conv", None), "fp32_precision", "none")
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(cudnn.allow_tf32)


def deterministic() -> bool:
    """Whether the user asked for deterministic algorithms (``torch.use_deterministic_algorithms``): the CUDA kernels
    whose reductions add in a varying order (float atomics) then hand the call to PyTorch's path."""
    return torch.are_deterministic_algorithms_enabled()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on `device_type` ("cuda", "cpu"), None where autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def contiguous_input(x: torch.Tensor) -> torch.Tensor:
    """x itself when it is contiguous NCHW or channels_last (what the stripe kernels read), else a contiguous copy
    (e.g. a channel slice of a larger tensor, as Res2Net's split branches give)."""
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return x
    return x.contiguous()


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)  # (nn.RNN's check too)


def autocast_inputs(*ts):
    """Under autocast, cast floating tensors other than float64 to the autocast dtype (as autocast casts F.conv2d's
    inputs: float64 is not eligible); otherwise unchanged."""
    if not _any_autocast():  # every eager layer call passes here: the common case answers in one C call
        return ts
    ref = next((t for t in ts if isinstance(t, torch.Tensor)), None)
    if ref is None:
        return ts
    dev = ref.device.type
    dt = autocast_dtype(dev) if dev in ("cuda", "cpu") else None
    if dt is None:
        return ts
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in ts)


# (is_fx_symbolic_tracing is newer; is_fx_tracing, which also answers True under torch.export, warns there)
_fx_symbolic_tracing = (getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None)
                        or torch.fx._symbolic_trace.is_fx_tracing)


def fx_tracing() -> bool:
    """Whether torch.fx symbolically traces this call (inputs are Proxies: a module then records one op call and
    no branch on them)."""
    return _fx_symbolic_tracing()


def tracing_or_compiling() -> bool:
    """Whether TorchScript traces or torch.compile compiles this call (the op, not an eager shortcut, must run)."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def recording(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on `tensors` (grad mode on and one of them requires grad). Runs on every
    eager layer call: in inference (grad mode off) it answers before looking at the tensors."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def conv2d_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation,
                groups: int = 1) -> torch.Tensor:
    """relu(conv2d(x, weight, bias)) for int/pair `padding`. On CUDA in plain inference (autograd not recording,
    no tracing, compiling or ONNX export) one cuDNN call, `torch.cudnn_convolution_relu`, with the bias add and
    the ReLU in the conv's epilogue: PyTorch's conv adds a bias in a separate elementwise kernel, and in a
    compact VGG16 at batch 256 those adds and the ReLUs were 30% of the forward on an H200
    (benchmarks/results/compact_profile_vgg16_real_h200.txt). Under autocast its inputs are cast first, as
    autocast casts F.conv2d's (the cuDNN call itself is not an autocast op). Elsewhere F.conv2d (which autocast
    casts itself), then the ReLU in place on the conv's fresh output (no second tensor; autograd records it as
    after any conv, whose backward does not read its output)."""
    if (
        x.is_cuda
        and not recording(x, weight, bias)
        and not (tracing_or_compiling() or functorch_active() or forward_ad_active() or torch.onnx.is_in_onnx_export())
    ):
        xc, wc, bc = autocast_inputs(x, weight, bias)
        if xc.dtype in KERNEL_DTYPES and wc.dtype == xc.dtype:
            return torch.cudnn_convolution_relu(xc, wc, bc, pair(stride), pair(padding), pair(dilation), groups)
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups).relu_()


def eager_inference() -> bool:
    """Whether this call runs in plain eager inference: grad mode off, no torch.func transform, no forward-mode AD
    level, no TorchScript tracing and no torch.compile. The test of a layer's per-call shortcut (`StripeConv2d`'s
    direct dense path), in one frame of C calls: it runs on every call of a small CPU layer, where each Python
    call counts. (torch.compile first: dynamo answers it while tracing, and cannot trace the C calls after it.)"""
    return not (torch.compiler.is_compiling() or torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()
                or _forward_ad.__dict__.get("_current_level", -1) >= 0 or torch._C._is_tracing())


_len_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_len_function_modes = getattr(torch._C, "_len_torch_function_stack", None)


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jacrev, functional_call under grad, ...) is running. Our
    torch.library ops have no functorch rules (PyTorch's custom ops support none under grad), so the modules that
    call them take standard PyTorch ops then, computing the same function."""
    return torch._C._are_functorch_transforms_active()


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (`torch.autograd.forward_ad.dual_level`): inputs may be dual tensors,
    whose tangents a direct kernel call would drop (our ops have no forward-mode formulas)."""
    return _forward_ad.__dict__.get("_current_level", -1) >= 0


def needs_standard_ops() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active: our ops have no functorch or forward-mode
    rules (a custom op under torch.func.jvp returns a zero tangent, silently), so the public functions and the
    modules compute the same function in PyTorch ops then."""
    return functorch_active() or forward_ad_active()


def _plain_values(t: torch.Tensor) -> bool:
    """Whether t's memory holds its values: not a lazily negated view (torch._neg_view, a conjugate's imaginary
    part) nor a ZeroTensor (no memory)."""
    return not t.is_neg() and not t._is_zerotensor()


def plain_eager(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """True where calling an op's kernels directly is the same as calling the op: plain tensors (no fake,
    functional or other subclass; a Parameter weight is fine), no TorchScript tracing, no torch.compile, no Python
    dispatch or function mode (FLOP counters, make_fx and export see the op), no torch.func transform, no
    forward-mode AD level, no lazily negated view or ZeroTensor (their memory does not hold their values; the
    dispatcher materialises them for an op). Every
    export path (TorchScript tracing, dynamo, fake-tensor export) makes it False. (torch.profiler records ops at
    the dispatcher, so a direct call shows as no op event; CUDA kernels still show.)"""
    return (not torch.compiler.is_compiling() and not torch.jit.is_tracing() and not functorch_active()
            and not forward_ad_active()
            and type(x) is torch.Tensor and (weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter))
            and _plain_values(x) and (weight is None or _plain_values(weight))
            and _len_dispatch_modes is not None and _len_function_modes is not None
            and _len_dispatch_modes() == 0 and _len_function_modes() == 0)


def tensor_version(t: torch.Tensor) -> int:
    """t's version counter, -1 for an inference tensor (which has none): part of a cache key."""
    return -1 if t.is_inference() else t._version


def unobserved() -> bool:
    """No Python dispatch or function mode (FLOP counters, make_fx, fake tensors) and no torch.profiler recording:
    only then is a direct C call in place of an op's dispatch invisible. For a layer's per-call shortcut."""
    return (_len_dispatch_modes is not None and _len_function_modes is not None and _len_dispatch_modes() == 0
            and _len_function_modes() == 0 and not getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def register_conv_double_backward(backward_op, forward_op) -> None:
    """Autograd for a conv's backward op, so that double backward works as with ``F.conv2d`` (gradient penalties,
    Hessian-vector products). ``backward_op(grad, x, weight, *conf) -> (dx, dw)``, ``forward_op(x, weight, bias,
    *conf) -> y``. Both outputs are bilinear, dx = conv_transpose(grad, weight) and dw = wgrad(x, grad), so with
    ggx, ggw the gradients of dx, dw: d/d grad = conv(ggx, weight) + conv(x, ggw) (two forward ops), d/dx =
    conv_transpose(grad, ggw) and d/d weight = wgrad(ggx, grad) (the backward op on (grad, x, ggw) and (grad, ggx,
    weight)). Calls the ops themselves, so higher orders follow."""

    def setup_context(ctx, inputs, output):
        grad, x, weight, *conf = inputs
        ctx.save_for_backward(grad, x, weight)
        ctx.conf = conf

    def double_backward(ctx, ggx, ggw):
        grad, x, weight = ctx.saved_tensors
        need_grad, need_x, need_w = ctx.needs_input_grad[:3]
        ggx = None if ggx is None else ggx.contiguous(memory_format=memory_format(ggx))
        ggw = None if ggw is None else ggw.contiguous()
        d_grad = d_x = d_w = None
        if need_grad:
            parts = [forward_op(a, w, None, *ctx.conf) for a, w in ((ggx, weight), (x, ggw))
                     if a is not None and w is not None]
            d_grad = sum(parts[1:], parts[0]) if parts else None
        if need_x and ggw is not None:
            d_x = backward_op(grad, x, ggw, *ctx.conf)[0]
        if need_w and ggx is not None:
            d_w = backward_op(grad, ggx, weight, *ctx.conf)[1]
        return (d_grad, d_x, d_w) + (None,) * len(ctx.conf)

    backward_op.register_autograd(double_backward, setup_context=setup_context)
