"""PiX channel fusion (Pick-or-Mix, CVPR 2024) as the custom op ``compress::pix``.

Semantics (DESIGN.md, official kernel of seed 003): x (B, C, H, W) is split into C/zeta contiguous groups of
zeta channels; p (B, C/zeta, 1, 1) is the fusion probability. ``y[b, g] = p[b, g] * max_group(x)`` if
``p[b, g] < tau`` else ``p[b, g] * mean_group(x)`` (p == tau takes the mean). Backward: the max branch sends
``p * dy`` to the FIRST arg-max channel only, the mean branch ``p * dy / zeta`` to every channel;
``dp = sum_hw (max or mean) * dy``. The p < tau test is done in float32 (float64 for float64 inputs).

The op computes in the input dtype (accumulating in float32); under autocast it is not cast (it is
memory-bound, a cast would cost a full pass); ``pix()`` casts ``p`` to ``x``'s dtype.

``compress::pix_squeeze`` is the whole PiX block, ``y = pix(x, sigmoid(mean_hw(x) @ W^T), zeta, tau)``, in one op
so that its backward never materialises the pooling gradient: the pool's (B, C) gradient divided by H*W is added
inside the kernel that writes dx (PyTorch's mean backward expands it to a full-size tensor and adds that to dx:
two extra full passes, 20% of a bf16 PiX ResNet-50 training step on an H200). Backward = a dp-only pass, the
tiny predictor math, and a dx pass. The pooled mean and the predictor run in float32 (float64 for float64 x)
whatever the autocast state; p is then cast to x's dtype for the fusion, and the p < tau test reads that cast p
(as a PyTorch PiX under bf16 autocast does): in bfloat16 a p within one bf16 step below tau takes the mean branch. On CUDA the whole forward and the
whole backward are one C++ call each (``pix_squeeze_forward/backward`` in csrc/pix.cu: the predictor math as
ATen calls there, not a dozen Python-level ops, which cost 20% of a batch-64 bf16 training step in host time).
On CPU (float32/float64, NCHW or channels_last) both ops run small C++ kernels (``kernels/_cpu.py``, compiled on
first use, PyTorch ops where no compiler is found): ``pix`` one fused pass; ``pix_squeeze`` one call that reads x
once for the pool and every group's max and sum, runs the predictor GEMV and then selects and scales (its CPU
backward recomputes p with the same GEMV). Eager CPU inference calls the CPU kernel without the dispatcher.
NaN: every path takes the max as PyTorch's amax does (a NaN in a group makes its max NaN, and its first NaN the
arg-max that the backward sends the gradient to); a NaN in the upstream gradient stays on its arg-max channel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import _cpu, _ext
from kernels._utils import (
    acc_dtype,
    check_4d,
    check_like,
    check_tau,
    deterministic,
    memory_format,
    needs_standard_ops,
    plain_eager,
    use_kernel,
    whole,
)

__all__ = ["pix", "pix_squeeze", "pix_reference", "residual_relu"]

OP = "compress::pix"
SQOP = "compress::pix_squeeze"
SQBOP = "compress::pix_squeeze_backward"
# The ops take NCHW and channels_last (any other strides through a copy) and return x's layout, so Inductor may
# hand them its activations as they are. Without the tag it converts each one to NCHW and back around the op,
# which left a compiled, weight-frozen PiX ResNet-50 on a 2-core CPU no faster than ResNet-50 (1.00-1.05x,
# against 1.10-1.22x with the tag; benchmarks/pix_cpu.py --compile).
_FLEXIBLE = (torch.Tag.flexible_layout,)


def _check(x: Tensor, p: Tensor, zeta: int, op: str = OP) -> None:
    check_4d(op, "x", x)
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{op}: 'p' must be a Tensor, got {type(p).__name__}")
    check_like(op, "p", p, x)
    if zeta < 1:
        raise ValueError(f"{op}: zeta must be >= 1, got {zeta}")
    B, C = x.shape[0], x.shape[1]
    if C % zeta != 0:
        raise ValueError(f"{op}: the channels of tensor 'x' ({C}) are not divisible by zeta={zeta}")
    if tuple(p.shape) != (B, C // zeta, 1, 1):
        raise ValueError(f"{op}: tensor 'p' must have shape {(B, C // zeta, 1, 1)} (B, C/zeta, 1, 1), got {tuple(p.shape)}")


def _forward_fast(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor | None:
    """Inference-speed forward for float32/float64 x (p of x's dtype) that is contiguous NCHW or channels_last
    (None otherwise). No copies of x: NCHW views x as (B, G, zeta, HW) and takes one max and one sum reduction
    over the zeta dim; channels_last views x as (B, HW, G, zeta) and folds the zeta strided slices elementwise
    (a reduction of size zeta over the innermost dim is slow), all into one fresh output (a view would break
    autograd's in-place checks downstream). The 1/zeta of the mean is folded into p:
    y = where(p < tau, p * max, (p / zeta) * sum), selected in place into the sum buffer."""
    B, C, H, W = x.shape
    G = C // zeta
    if zeta < 2 or x.dtype != acc_dtype(x.dtype) or p.dtype != x.dtype or x.numel() == 0:
        return None
    pick = (p < tau).view(B, G)
    scale = torch.where(pick, p.view(B, G), p.view(B, G) / zeta)
    if memory_format(x) == torch.channels_last:
        if not x.permute(0, 2, 3, 1).is_contiguous():
            return None
        y = torch.empty((B, G, H, W), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
        xg, sm = x.permute(0, 2, 3, 1).view(B, H * W, G, zeta), y.permute(0, 2, 3, 1).view(B, H * W, G)
        mx = torch.maximum(xg[..., 0], xg[..., 1])
        torch.add(xg[..., 0], xg[..., 1], out=sm)
        for i in range(2, zeta):
            torch.maximum(mx, xg[..., i], out=mx)
            sm.add_(xg[..., i])
        torch.where(pick.view(B, 1, G), mx, sm, out=sm)
        sm.mul_(scale.view(B, 1, G))
        return y
    if not x.is_contiguous():
        return None
    y = x.new_empty((B, G, H, W))
    xg, sm = x.view(B, G, zeta, H * W), y.view(B, G, H * W)
    mx = xg.amax(2)
    torch.sum(xg, 2, out=sm)
    torch.where(pick.view(B, G, 1), mx, sm, out=sm)
    sm.mul_(scale.view(B, G, 1))
    return y


def _forward_c(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor | None:
    """The C++ CPU fusion (kernels/_cpu.py) for CPU float32/float64 x that is contiguous NCHW or channels_last,
    p of x's dtype; None where it does not apply or the library is unavailable (the caller takes PyTorch ops)."""
    if x.device.type != "cpu" or x.dtype not in _C_DTYPES or p.dtype != x.dtype or x.numel() == 0:
        return None
    cl = memory_format(x) == torch.channels_last
    if not (cl or x.is_contiguous()) or (lib := _cpu.lib()) is None:
        return None
    B, C, H, W = x.shape
    G = C // zeta
    p = p.reshape(B, G).contiguous()
    y = torch.empty((B, G, H, W), dtype=x.dtype, memory_format=torch.channels_last if cl else torch.contiguous_format)
    fn = _C_FUNCS[cl, x.dtype]
    if getattr(lib, fn)(x.data_ptr(), p.data_ptr(), y.data_ptr(), B, G, zeta, H * W, tau):
        raise MemoryError(f"{OP}: out of memory in the CPU kernel {fn}")
    return y


_C_DTYPES = (torch.float32, torch.float64)
_C_FUNCS = {(False, torch.float32): "pix_nchw_f32", (False, torch.float64): "pix_nchw_f64",
            (True, torch.float32): "pix_cl_f32", (True, torch.float64): "pix_cl_f64"}


def _forward_cpu(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor:
    y = _forward_c(x, p, zeta, tau)
    return _forward_torch(x, p, zeta, tau) if y is None else y


def _forward_torch(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor:
    y = _forward_fast(x, p, zeta, tau)
    if y is not None:
        return y
    return _pix_ops(x, p, zeta, tau).contiguous(memory_format=memory_format(x))


def _backward_torch(grad: Tensor, x: Tensor, p: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    B, C, H, W = x.shape
    acc = acc_dtype(x.dtype)
    xg = x.unflatten(1, (C // zeta, zeta)).to(acc)  # (B, G, zeta, H, W)
    mx = xg.amax(2, keepdim=True)
    is_max = (xg == mx) | (xg.isnan() & mx.isnan())  # (a NaN max: the NaN channels, as torch.max's argmax)
    first = is_max & (is_max.cumsum(2) == 1)  # first arg-max channel only
    pf = p.to(acc)  # (B, G, 1, 1)
    use_max = pf < tau
    g = grad.to(acc)
    pg = (pf * g).unsqueeze(2)  # (B, G, 1, H, W)
    picked = torch.where(first, pg, 0.0)  # (a select, not first * pg: a NaN gradient stays on its channel)
    dx = torch.where(use_max.unsqueeze(2), picked, (pg / zeta).expand_as(xg))
    dx = dx.flatten(1, 2).to(x.dtype).contiguous(memory_format=memory_format(x))
    sel = torch.where(use_max, mx.squeeze(2), xg.mean(2))
    dp = (sel * g).sum((2, 3), keepdim=True).to(p.dtype)
    return dx, dp


@torch.library.custom_op(OP, mutates_args=(), tags=_FLEXIBLE)
def _pix_op(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor:
    _check(x, p, zeta)
    return _forward_cpu(x, p, zeta, tau)


@_pix_op.register_kernel("cuda")
def _pix_cuda(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor:
    _check(x, p, zeta)
    ext = _ext.load() if use_kernel(x) else None
    if ext is None or x.numel() == 0:
        return _forward_torch(x, p, zeta, tau)
    fmt = memory_format(x)
    return ext.pix_forward(x.contiguous(memory_format=fmt), p.contiguous(), zeta, tau,
                           fmt == torch.channels_last)


@_pix_op.register_fake
def _pix_fake(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor:
    _check(x, p, zeta)
    B, C, H, W = x.shape
    return x.new_empty((B, C // zeta, H, W)).contiguous(memory_format=memory_format(x))


@torch.library.custom_op("compress::pix_backward", mutates_args=(), tags=_FLEXIBLE)
def _pix_backward_op(grad: Tensor, x: Tensor, p: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    _check(x, p, zeta, "compress::pix_backward")
    _check_grad(grad, x, zeta)
    return _backward_torch(grad, x, p, zeta, tau)


def _check_grad(grad: Tensor, x: Tensor, zeta: int, op: str = "compress::pix_backward") -> None:
    check_4d(op, "grad", grad)
    check_like(op, "grad", grad, x)
    B, C, H, W = x.shape
    if tuple(grad.shape) != (B, C // zeta, H, W):
        raise ValueError(f"{op}: tensor 'grad' must have shape {(B, C // zeta, H, W)}, got {tuple(grad.shape)}")


@_pix_backward_op.register_kernel("cuda")
def _pix_backward_cuda(grad: Tensor, x: Tensor, p: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    _check(x, p, zeta, "compress::pix_backward")
    _check_grad(grad, x, zeta)
    # (dp adds per-warp shares with shared-memory float atomics: PyTorch's path where determinism is asked for)
    ext = _ext.load() if use_kernel(x) and not deterministic() else None
    if ext is None or x.numel() == 0:
        return _backward_torch(grad, x, p, zeta, tau)
    fmt = memory_format(x)
    dx, dp = ext.pix_backward(grad.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt),
                              p.contiguous(), zeta, tau, fmt == torch.channels_last)
    return dx, dp


@_pix_backward_op.register_fake
def _pix_backward_fake(grad: Tensor, x: Tensor, p: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    _check(x, p, zeta, "compress::pix_backward")
    return torch.empty_like(x, memory_format=memory_format(x)), torch.empty_like(p, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, p, zeta, tau = inputs
    ctx.save_for_backward(x, p)
    ctx.zeta, ctx.tau = zeta, tau


def _backward(ctx, grad):
    x, p = ctx.saved_tensors
    dx, dp = _pix_backward_op(grad, x, p, ctx.zeta, ctx.tau)
    return dx, dp, None, None


_pix_op.register_autograd(_backward, setup_context=_setup_context)


def pix(x: Tensor, p: Tensor, zeta: int, tau: float = 0.5) -> Tensor:
    """PiX channel fusion: output channel j of group x[:, j*zeta:(j+1)*zeta] is ``p * max`` of the group where
    ``p < tau``, else ``p * mean`` (per image and pixel; p per image and output channel).

    Args:
        x: (B, C, H, W) float32/float16/bfloat16/float64, NCHW or channels_last (CPU: C++ for float32/float64;
            CUDA: the compiled kernel for the 32- and 16-bit types; the rest takes PyTorch ops).
        p: (B, C // zeta, 1, 1) fusion probabilities (cast to ``x``'s dtype).
        zeta: group size; ``C % zeta`` must be 0.
        tau: threshold; ``p < tau`` picks the max of the group, otherwise the mean (either scaled by p).

    Returns:
        y: (B, C // zeta, H, W), channels_last if ``x`` is.
    """
    p = _p_cast(x, p)
    zeta, tau = whole(zeta, "pix: zeta"), check_tau("pix", tau)
    if needs_standard_ops():  # torch.func, forward-mode AD: the same function in PyTorch ops
        return pix_reference(x, p, zeta, tau)
    return _pix_op(x, p, zeta, tau)


def _p_cast(x, p):
    """p in x's dtype where x is floating (`pix` and `pix_reference` cast p of any dtype, as `pix` always did);
    anything else as given, for the checks to name."""
    if isinstance(p, torch.Tensor) and isinstance(x, torch.Tensor) and p.dtype != x.dtype and x.dtype.is_floating_point:
        return p.to(x.dtype)
    return p


# ------------------------------------------------------------------------------------------ pix_squeeze
def _check_squeeze(x: Tensor, weight: Tensor, zeta: int, op: str = SQOP) -> None:
    check_4d(op, "x", x)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: 'weight' must be a Tensor, got {type(weight).__name__}")
    if weight.device != x.device:
        raise ValueError(f"{op}: tensor 'weight' is on {weight.device} but 'x' is on {x.device}")
    if not weight.is_floating_point():
        raise TypeError(f"{op}: tensor 'weight' must be floating point, got {weight.dtype}")
    if zeta < 1:
        raise ValueError(f"{op}: zeta must be >= 1, got {zeta}")
    C = x.shape[1]
    if C % zeta != 0:
        raise ValueError(f"{op}: the channels of tensor 'x' ({C}) are not divisible by zeta={zeta}")
    if tuple(weight.shape) not in ((C // zeta, C, 1, 1), (C // zeta, C)):
        raise ValueError(f"{op}: tensor 'weight' must have shape {(C // zeta, C, 1, 1)} (C/zeta, C, 1, 1), "
                         f"got {tuple(weight.shape)}")


def _predict(pooled: Tensor, weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """p = sigmoid(pooled @ W^T) for pooled (B, C) in float32/64: (p (B, G) in pooled's dtype, p cast to `dtype`
    as (B, G, 1, 1), the tensor the fusion uses)."""
    with torch.autocast(pooled.device.type, enabled=False):
        p = torch.sigmoid(pooled @ weight.reshape(weight.shape[0], -1).to(pooled.dtype).t())
    return p, p.to(dtype)[:, :, None, None].contiguous()


def _squeeze_torch(x: Tensor, weight: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    pooled = x.mean((2, 3), dtype=acc_dtype(x.dtype))
    return _forward_torch(x, _predict(pooled, weight, x.dtype)[1], zeta, tau), pooled


def _c_squeeze_ok(x: Tensor) -> bool:
    """Whether the C++ CPU block runs for x: CPU float32/float64, non-empty, contiguous NCHW or channels_last, and
    the library built. The forward and the backward decide alike (same x), so the backward recomputes the same p."""
    return (x.device.type == "cpu" and x.dtype in _C_DTYPES and x.numel() > 0
            and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)) and _cpu.lib() is not None)


def _c_weight(weight: Tensor, x: Tensor) -> Tensor:
    """The predictor as the C kernels read it, G * C contiguous values in x's dtype: ``weight`` itself where it
    already is (a contiguous (G, C, 1, 1) holds them in (G, C) order), else a converted (G, C) copy."""
    if weight.dtype == x.dtype and weight.is_contiguous():
        return weight
    return weight.reshape(weight.shape[0], x.shape[1]).to(x.dtype).contiguous()


def _squeeze_c(x: Tensor, weight: Tensor, zeta: int, tau: float,
               keep_pooled: bool = True) -> tuple[Tensor, Tensor | None]:
    """The whole block in one C++ call (kernels/_cpu.py), for x with ``_c_squeeze_ok(x)``: pass 1 reads x once
    for the pool (accumulated in double) and each group's max and sum, then p = sigmoid(pooled @ W^T) (float32
    GEMV, float64 for float64 x; whatever the autocast state), then pass 2 selects and scales. Returns (y, the
    pool (B, C)); without ``keep_pooled`` the pool stays in the kernel's scratch and None is returned for it."""
    B, C, H, W = x.shape
    cl = not x.is_contiguous()
    w = _c_weight(weight, x)
    pooled = torch.empty((B, C), dtype=x.dtype) if keep_pooled else None
    y = torch.empty((B, C // zeta, H, W), dtype=x.dtype,
                    memory_format=torch.channels_last if cl else torch.contiguous_format)
    fn = _C_SQUEEZE[cl, x.dtype]
    if fn(x.data_ptr(), w.data_ptr(), None if pooled is None else pooled.data_ptr(), y.data_ptr(), B, C, zeta,
          H * W, tau):
        raise MemoryError(f"{SQOP}: out of memory in the CPU kernel")
    return y, pooled


def squeeze_cpu_call(weight: Tensor, dtype: torch.dtype, zeta: int, tau: float) -> Callable[[Tensor], Tensor | None] | None:
    """For a PiX layer's eager CPU inference: ``x -> pix_squeeze(x, weight, zeta, tau)`` through the C++ block
    with every argument bound now, reading ``weight``'s own memory (so edits to it show, whatever way they are
    made), for a plain (no subclass, strided, no lazily negated view or ZeroTensor), non-empty 4-D CPU ``x`` of
    ``dtype``, of ``weight``'s C channels, contiguous NCHW or channels_last; None for any other x. None instead
    of the call where the C++ block does not run (float16/bfloat16, no library) or would need a converted copy
    of the predictor (``weight`` not contiguous or not of ``dtype``), and where ``weight`` is not the
    (C // zeta, C, 1, 1) or (C // zeta, C) predictor of ``zeta`` (the op names that error). The caller makes sure
    nothing traces, records or observes (``eager_inference``, ``unobserved``) and that ``weight`` is the same
    tensor of the same shape since (``compress.pix.PiXBlock._eager_cpu_output``, which says why)."""
    if dtype not in _C_DTYPES or weight.dtype != dtype or not weight.is_contiguous() or _cpu.lib() is None:
        return None
    G, C = weight.shape[0], weight.shape[1]
    if weight.dim() not in (2, 4) or weight.shape[2:] not in ((), (1, 1)) or zeta < 1 or G * zeta != C:
        return None
    w_ptr, fns = weight.data_ptr(), (_C_SQUEEZE[False, dtype], _C_SQUEEZE[True, dtype])
    cl_format, strided, plain = torch.channels_last, torch.strided, torch.Tensor

    def call(x: Tensor) -> Tensor | None:
        if (type(x) is not plain or x.dtype is not dtype or not x.is_cpu or x.layout is not strided or x.dim() != 4
                or x.size(1) != C or x.numel() == 0 or x.is_neg() or x._is_zerotensor()):
            return None
        cl = not x.is_contiguous()
        if cl and not x.is_contiguous(memory_format=cl_format):
            return None
        B, _, H, W = x.shape
        y = torch.empty((B, G, H, W), dtype=dtype, memory_format=cl_format if cl else torch.contiguous_format)
        if fns[cl](x.data_ptr(), w_ptr, None, y.data_ptr(), B, C, zeta, H * W, tau):
            raise MemoryError(f"{SQOP}: out of memory in the CPU kernel")
        return y

    call.keepalive = weight.detach()  # (w_ptr points into its storage)
    return call


class _CFuncs(dict):
    """(channels_last, dtype) -> the C function, resolved once from the loaded library."""

    def __init__(self, stem: str):
        super().__init__()
        self.stem = stem

    def __missing__(self, key):
        cl, dtype = key
        name = self.stem.format(layout="cl" if cl else "nchw", t="f32" if dtype == torch.float32 else "f64")
        fn = self[key] = getattr(_cpu.lib(), name)
        return fn


_C_SQUEEZE = _CFuncs("pix_squeeze_{layout}_{t}")
_C_PREDICT = _CFuncs("pix_predict_{t}")


def _predict_c(pooled: Tensor, weight: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """``_predict`` through the C++ GEMV of the forward (bit-identical p, so the backward takes the same branches)."""
    B, C = pooled.shape
    w = _c_weight(weight, x)
    p = torch.empty((B, w.shape[0]), dtype=x.dtype)
    _C_PREDICT[False, x.dtype](pooled.contiguous().data_ptr(), w.data_ptr(), p.data_ptr(), B, C, w.shape[0])
    return p, p[:, :, None, None]


def _squeeze_cpu(x: Tensor, weight: Tensor, zeta: int, tau: float,
                 keep_pooled: bool = True) -> tuple[Tensor, Tensor | None]:
    """(y, pool): the C++ block where it runs (``keep_pooled=False``, for eager inference: the pool stays in its
    scratch, one allocation less, and None comes back for it), else PyTorch ops."""
    if _c_squeeze_ok(x):
        return _squeeze_c(x, weight, zeta, tau, keep_pooled)
    return _squeeze_torch(x, weight, zeta, tau)


@torch.library.custom_op(SQOP, mutates_args=(), tags=_FLEXIBLE)
def _pix_squeeze_op(x: Tensor, weight: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    _check_squeeze(x, weight, zeta)
    return _squeeze_cpu(x, weight, zeta, tau)


@_pix_squeeze_op.register_kernel("cuda")
def _pix_squeeze_cuda(x: Tensor, weight: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    _check_squeeze(x, weight, zeta)
    ext = _ext.load() if use_kernel(x) else None
    if ext is None or x.numel() == 0:
        return _squeeze_torch(x, weight, zeta, tau)
    return _squeeze_ext(ext, x, weight, zeta, tau)


def _squeeze_ext(ext, x: Tensor, weight: Tensor, zeta: int, tau: float,
                 pooled: Tensor | None = None) -> tuple[Tensor, Tensor]:
    fmt = memory_format(x)
    return tuple(ext.pix_squeeze_forward(x.contiguous(memory_format=fmt), weight, zeta, tau, fmt == torch.channels_last,
                                         pooled))


def _squeeze_backward_ext(ext, grad: Tensor, x: Tensor, weight: Tensor, pooled: Tensor, zeta: int,
                          tau: float) -> tuple[Tensor, Tensor]:
    fmt = memory_format(x)
    return tuple(ext.pix_squeeze_backward(grad.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt), weight,
                                          pooled, zeta, tau, fmt == torch.channels_last))


@_pix_squeeze_op.register_fake
def _pix_squeeze_fake(x: Tensor, weight: Tensor, zeta: int, tau: float) -> tuple[Tensor, Tensor]:
    _check_squeeze(x, weight, zeta)
    B, C, H, W = x.shape
    y = x.new_empty((B, C // zeta, H, W)).contiguous(memory_format=memory_format(x))
    return y, x.new_empty((B, C), dtype=acc_dtype(x.dtype))


def _squeeze_grads(dp: Tensor, p: Tensor, pooled: Tensor, weight: Tensor, hw: int) -> tuple[Tensor, Tensor]:
    """From dp (B, G, 1, 1): (dweight like weight, the pooling gradient / (H*W) as (B, C) in pooled's dtype)."""
    with torch.autocast(pooled.device.type, enabled=False):
        dlogit = dp.reshape(p.shape).to(p.dtype) * p * (1 - p)  # (B, G)
        w = weight.reshape(weight.shape[0], -1).to(p.dtype)
        dweight = (dlogit.t() @ pooled).reshape(weight.shape).to(weight.dtype)
        return dweight, (dlogit @ w) / hw


def _squeeze_backward_torch(grad: Tensor, x: Tensor, weight: Tensor, pooled: Tensor, zeta: int,
                            tau: float, predict=None) -> tuple[Tensor, Tensor]:
    p32, p = predict(pooled, weight, x) if predict is not None else _predict(pooled, weight, x.dtype)
    dx, dp = _backward_torch(grad, x, p, zeta, tau)
    dweight, add = _squeeze_grads(dp, p32, pooled, weight, x.shape[2] * x.shape[3])
    dx = (dx.to(add.dtype) + add[:, :, None, None]).to(x.dtype).contiguous(memory_format=memory_format(x))
    return dx, dweight


def _check_pooled(pooled: Tensor, x: Tensor, op: str = SQBOP) -> None:
    """`pooled`, the forward's second output: mean_hw(x), (B, C) in float32 (float64 for float64 x)."""
    want = (x.shape[0], x.shape[1])
    if not isinstance(pooled, Tensor):
        raise TypeError(f"{op}: 'pooled' must be a Tensor, got {type(pooled).__name__}")
    if tuple(pooled.shape) != want or pooled.dtype != acc_dtype(x.dtype) or pooled.device != x.device:
        raise ValueError(f"{op}: tensor 'pooled' must be the forward's pool of x, shape {want} {acc_dtype(x.dtype)} "
                         f"on {x.device}, got shape {tuple(pooled.shape)} {pooled.dtype} on {pooled.device}")


@torch.library.custom_op(SQBOP, mutates_args=(), tags=_FLEXIBLE)
def _pix_squeeze_backward_op(grad: Tensor, x: Tensor, weight: Tensor, pooled: Tensor, zeta: int,
                             tau: float) -> tuple[Tensor, Tensor]:
    _check_squeeze(x, weight, zeta, SQBOP)
    _check_grad(grad, x, zeta, SQBOP)
    _check_pooled(pooled, x)
    return _squeeze_backward_torch(grad, x, weight, pooled, zeta, tau, _predict_c if _c_squeeze_ok(x) else None)


@_pix_squeeze_backward_op.register_kernel("cuda")
def _pix_squeeze_backward_cuda(grad: Tensor, x: Tensor, weight: Tensor, pooled: Tensor, zeta: int,
                               tau: float) -> tuple[Tensor, Tensor]:
    _check_squeeze(x, weight, zeta, SQBOP)
    _check_grad(grad, x, zeta, SQBOP)
    _check_pooled(pooled, x)
    ext = _ext.load() if use_kernel(x) and not deterministic() else None  # (its dp: as pix's backward)
    if ext is None or x.numel() == 0:
        return _squeeze_backward_torch(grad, x, weight, pooled, zeta, tau)
    return _squeeze_backward_ext(ext, grad, x, weight, pooled, zeta, tau)


@_pix_squeeze_backward_op.register_fake
def _pix_squeeze_backward_fake(grad: Tensor, x: Tensor, weight: Tensor, pooled: Tensor, zeta: int,
                               tau: float) -> tuple[Tensor, Tensor]:
    _check_squeeze(x, weight, zeta, SQBOP)
    _check_grad(grad, x, zeta, SQBOP)
    _check_pooled(pooled, x)
    return torch.empty_like(x, memory_format=memory_format(x)), torch.empty_like(weight)


def _squeeze_setup_context(ctx, inputs, output):
    x, weight, zeta, tau = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])
    ctx.zeta, ctx.tau = zeta, tau


def _squeeze_backward(ctx, grad, _grad_pooled):
    x, weight, pooled = ctx.saved_tensors
    dx, dweight = _pix_squeeze_backward_op(grad, x, weight, pooled, ctx.zeta, ctx.tau)
    return dx, dweight, None, None


_pix_squeeze_op.register_autograd(_squeeze_backward, setup_context=_squeeze_setup_context)


def pix_squeeze(x: Tensor, weight: Tensor, zeta: int, tau: float = 0.5) -> Tensor:
    """The PiX block in one op: ``pix(x, sigmoid(mean_hw(x) @ weight^T), zeta, tau)``.

    Args:
        x: (B, C, H, W) float32/float16/bfloat16/float64, NCHW or channels_last.
        weight: (C // zeta, C, 1, 1) or (C // zeta, C), the bias-free predictor (any float dtype; the pool and
            the predictor run in float32, float64 for float64 x).
        zeta, tau: as ``pix``.

    Returns:
        y: (B, C // zeta, H, W) in x's dtype, channels_last if ``x`` is.

    Plain eager calls (no tracing, compiling or Python modes; see ``plain_eager``) skip the dispatcher: CPU
    inference (unless torch.profiler records) calls the op's CPU implementation (the round trip is a few % of a batch-1 PiX ResNet-50 forward),
    CUDA calls the op's C++ functions, through ``_PixSqueezeCUDA`` when autograd records, and takes the channel
    mean that ``residual_relu`` kept on x instead of computing it (see there).
    """
    zeta, tau = whole(zeta, "pix_squeeze: zeta"), check_tau("pix_squeeze", tau)
    if weight is not None and plain_eager(x, weight):
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        # under torch.profiler CPU calls take the op, so that its time is attributed to it (the same C++ kernel);
        # CUDA calls stay direct: the op would recompute the mean residual_relu kept, and the kernels show anyway
        if x.device.type == "cpu" and not grad and not getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
            _check_squeeze(x, weight, zeta)
            return _squeeze_cpu(x, weight, zeta, tau, keep_pooled=False)[0]
        ext = _ext.load() if x.is_cuda and use_kernel(x) and x.numel() else None
        if ext is not None and not (grad and deterministic()):  # (a deterministic backward: the op's)
            _check_squeeze(x, weight, zeta)
            pooled = _attached_mean(x)
            if grad:
                return _PixSqueezeCUDA.apply(x, weight, zeta, tau, pooled)
            return _squeeze_ext(ext, x, weight, zeta, tau, pooled)[0]
    elif needs_standard_ops():  # torch.func, forward-mode AD: the same function in PyTorch ops
        _check_squeeze(x, weight, zeta)
        return pix_squeeze_ops(x, weight, zeta, tau)
    return _pix_squeeze_op(x, weight, zeta, tau)[0]


class _PixSqueezeCUDA(torch.autograd.Function):
    """Plain eager CUDA training: the op's CUDA forward and backward (the same C++ calls) without the custom op's
    Python dispatch layers, which cost ~60 us of host time per block and made a batch-64 bf16 PiX ResNet-50 step
    host-bound on an H200. Anything that traces, compiles or intercepts goes through the registered op."""

    @staticmethod
    def forward(ctx, x, weight, zeta, tau, pooled):
        y, pooled = _squeeze_ext(_ext.load(), x, weight, zeta, tau, pooled)
        ctx.save_for_backward(x, weight, pooled)
        ctx.zeta, ctx.tau = zeta, tau
        return y

    @staticmethod
    def backward(ctx, grad):
        # the pool's gradient goes into dx (inside the dx kernel), so a precomputed `pooled` gets none
        x, weight, pooled = ctx.saved_tensors
        dx, dweight = _squeeze_backward_ext(_ext.load(), grad, x, weight, pooled, ctx.zeta, ctx.tau)
        return dx, dweight, None, None, None


# ------------------------------------------------------------------------ residual tail + the next pool
_MEAN_ATTR = "_compress_channel_mean"  # (pooled (B, C) float32, tensor version when it was computed)


def residual_relu(out: Tensor, identity: Tensor) -> Tensor:
    """``relu(out + identity)``, a residual block's tail; ``out`` (B, C, H, W) is consumed like torchvision's
    ``out += identity`` (it may be overwritten), ``identity`` has its shape.

    In plain eager mode on CUDA, with ``out`` and ``identity`` of one float dtype and layout, it is one kernel
    that also computes the result's channel mean (float32) and keeps it on the returned tensor: a ``pix_squeeze``
    of that tensor (while unmodified: its version is checked) then reads x once instead of twice, and the
    separate ReLU pass is gone. Differentiable (the kept mean is a cached statistic, not an autograd output;
    ``pix_squeeze`` routes the pool's gradient through its own dx). CPU inference (float32/64, same shape and
    dtype, no gradient recorded) is PyTorch's fused ``aten::_add_relu_``: one pass where add + ReLU take two;
    no mean is kept there, since the CPU ``pix_squeeze``
    pools in the same read of x that finds the group max and sum. Elsewhere: ``out.add_(identity).relu_()``.
    """
    if (type(out) is torch.Tensor and type(identity) is torch.Tensor and not torch.jit.is_tracing()
            and out.shape != identity.shape):  # (traced shapes are tensors: comparing them warns)
        raise ValueError(f"residual_relu: 'identity' must have the shape of 'out' {tuple(out.shape)}, got "
                         f"{tuple(identity.shape)} (no broadcasting: a shortcut that changes shape needs its downsample)")
    plain = (plain_eager(out, identity) and out.dtype == identity.dtype and out.shape == identity.shape
             and out.device == identity.device and type(identity) is torch.Tensor)
    recording = torch.is_grad_enabled() and (out.requires_grad or identity.requires_grad)
    if recording and out.requires_grad and (out.is_leaf or out._is_view()):  # a leaf (or a view of one) cannot be
        return torch.relu(out + identity)  # overwritten in a recorded graph
    if plain and out.device.type == "cpu" and out.dtype in (torch.float32, torch.float64) and not recording:
        return torch.ops.aten._add_relu_(out, identity)
    if (plain and out.is_cuda and out.dtype in (torch.float32, torch.float16, torch.bfloat16) and out.dim() == 4
            and use_kernel(out)):
        fmt = memory_format(out)
        same_layout = out.is_contiguous(memory_format=fmt) and identity.is_contiguous(memory_format=fmt)
        ext = _ext.load() if same_layout else None
        if ext is not None:
            cl = fmt == torch.channels_last
            y, pooled = _ResidualReluCUDA.apply(out, identity, cl) if recording else _add_relu_pool(ext, out, identity, cl)
            setattr(y, _MEAN_ATTR, (pooled, y._version))
            return y
    return out.add_(identity).relu_()


def _add_relu_pool(ext, out: Tensor, identity: Tensor, cl: bool) -> tuple[Tensor, Tensor]:
    """The extension's (relu(out + identity), channel mean) without autograd. Under ``torch.inference_mode`` the
    result is made a normal tensor (the call runs outside inference mode; its inputs may be inference tensors): an
    inference tensor keeps no version counter, and the kept mean is valid only while the result's version is the
    one it was computed at (in-place changes to a normal tensor bump it inside inference mode too)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return ext.add_relu_pool(out, identity, cl)
    return ext.add_relu_pool(out, identity, cl)


def _attached_mean(x: Tensor) -> Tensor | None:
    """The channel mean ``residual_relu`` kept on x, if x is unmodified since; else None."""
    kept = getattr(x, _MEAN_ATTR, None)
    if kept is None or kept[1] != x._version:
        return None
    return kept[0]


class _ResidualReluCUDA(torch.autograd.Function):
    """(relu(a + b), its channel mean) by the fused CUDA kernel; backward ``g * (y > 0)`` to both inputs (the
    mean is a non-differentiable output: its consumer, ``pix_squeeze``, sends the pool's gradient through dx)."""

    @staticmethod
    def forward(ctx, a, b, cl):
        y, pooled = _ext.load().add_relu_pool(a, b, cl)
        ctx.mark_non_differentiable(pooled)
        ctx.save_for_backward(y)
        return y, pooled

    @staticmethod
    def backward(ctx, grad, _grad_pooled):
        (y,) = ctx.saved_tensors
        g = torch.ops.aten.threshold_backward(grad, y, 0)
        return g, g, None


def pix_reference(x: Tensor, p: Tensor, zeta: int, tau: float = 0.5) -> Tensor:
    """``pix`` in PyTorch ops (no custom op), the same function: p rounded to x's dtype, then it, the group max and
    the group mean in float32 (float64 for float64 x), so ``p < tau`` takes the op's branch also where p rounds to
    tau in 16 bits; the output in x's dtype. Differentiable through autograd, torch.func and forward-mode AD (the
    max's gradient splits among ties, the op's goes to the first). ``pix`` runs it under torch.func transforms and
    forward-mode AD; the benchmarks' 'torch ops' baseline."""
    p = _p_cast(x, p)
    _check(x, p, zeta, "pix_reference")
    return _pix_ops(x, p, zeta, tau)


def _pix_ops(x: Tensor, p: Tensor, zeta: int, tau: float) -> Tensor:
    """`pix_reference` without its checks (an ONNX export traces this: no shape comparisons); also the op's own
    PyTorch path where `_forward_fast` does not apply."""
    acc = acc_dtype(x.dtype)
    p = p.to(x.dtype).to(acc)
    groups = x.unflatten(1, (-1, zeta))
    return (p * torch.where(p < tau, groups.amax(2), groups.to(acc).mean(2))).to(x.dtype)


def pix_squeeze_ops(x: Tensor, weight: Tensor, zeta: int, tau: float) -> Tensor:
    """``pix_squeeze`` in PyTorch ops, unchecked: the pool and the bias-free predictor in float32 (float64 for
    float64 x), then `pix_reference`'s fusion. ``pix_squeeze`` runs it (after its checks) under torch.func transforms
    and forward-mode AD, PiXBlock in ONNX export (traced: no shape comparisons)."""
    acc = acc_dtype(x.dtype)
    p = torch.sigmoid(x.to(acc).mean((2, 3)) @ weight.flatten(1).t().to(acc))
    return _pix_ops(x, p[:, :, None, None], zeta, tau)
