"""Per-layer and total cost of a model for one input: params, MACs, weight bytes, activations, latency.

    report = compress.profile(model, input_size=(3, 32, 32))
    report.to_dict()["macs"]; compress.compare(dense_report, compact_report)

Units: MACs are multiply-adds (1 multiply-add = 1 MAC, FLOPs = 2 MACs). Counted layers are
convolutions (also our kernels' ``Im2colConv2d`` and ``DepthwiseConv2d``), Linear, and custom
modules through their `macs(inp, out)` method (the extension protocol of docs/INTERFACES.md: a
StripeConv2d counts its kept stripes, a PiX block its real work).
Everything else (BatchNorm, activations, pooling, residual adds) counts 0 MACs, as in the
literature totals (ResNet-50: 4.1 GMACs). Extra layer types plug in with `register_macs_handler`.

Two conventions (`profile(..., convention=...)`; the report records which one it used):

- ``"layers"`` (default): convs, Linear and custom ``macs()`` only, as above (ResNet-50: 4.09 G).
- ``"paper"``: as the PiX paper and ptflops count, which adds (`_PAPER_EXTRA`, one small table):
  conv/Linear bias 1 per output element, BatchNorm 2 per element (scale and shift), ReLU-style
  activations 1 per element, pooling 1 per input element. Residual adds still count 0. This
  reproduces ResNet-50 4.12 G and the PiX totals of paper Table 1 within 1% (PiX ResNet-50/101/152
  at zeta 4: 3.18/6.05/8.91 G; thin ResNet-50 at zeta 8: 1.39 G, where "layers" gives 1.367 G).

Convolutions and matrix products that forward code calls itself (``F.conv2d(x, self.conv.weight)``,
``x @ w``, ``F.linear``, ``torch.einsum``, ``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``, whose
inference fast path is turned off for the count) count too: the count pass watches the dispatcher (a
``TorchDispatchMode``, as ``torch.utils.flop_counter`` does) and adds, in both conventions, the MACs of every
``aten`` convolution, ``mm``/``addmm``/``bmm``/``baddbmm``/``addbmm``/``mv``/``addmv``/``dot`` and fused attention,
and of our kernels' ops (``compress::conv2d``, ``depthwise_conv2d`` and ``stripe_conv2d`` as convs of their weight;
``pix_squeeze`` and ``pix`` as a PiX block's real work), that runs outside a counted layer's forward (a layer with
a handler or ``macs()`` accounts for its own work) to the row of the innermost module whose forward, or hook,
called it (a row with no params of its own if that module has no row otherwise); ``ProfileReport.functional_macs``
sums them. Other functional ops (``F.relu``, pooling, ``x + y``) add nothing, also in the "paper" convention, and
neither do fused recurrent kernels (``nn.LSTM``) or ``F.bilinear``.

Profiled layers are the leaf modules, every module with a `macs` method (whose children are
then not profiled separately) and every other module that holds parameters or buffers of its own
(timm's BatchNormAct2d, a layer-scale gamma): its row counts those and its own output, its children
have rows of their own, and its latency includes its children's. Rows come from forward calls, so the rows'
params and weight bytes add up to the totals except for modules whose weights their parent reads itself and
never calls (nn.MultiheadAttention's out_proj, a conv used as ``F.conv2d(x, self.conv.weight)``): those count
in the totals only. Activation bytes are the outputs of profiled layers for one input,
counting each newly allocated tensor once (an in-place op or a view of its input adds nothing).
Weight bytes are the bytes of all parameters and persistent buffers (BN statistics, stripe
indices), excluding BatchNorm's `num_batches_tracked` counter.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode

from compress._checks import check_module, check_one_input, check_real, chw
from compress._modes import LIBRARY_LOCK, evaluating
from compress.pix import ResidualReLU, pix_macs
from compress.stripe import Conv2dReLU, StripeConv2d
from kernels import DepthwiseConv2d, Im2colConv2d

__all__ = ["LayerProfile", "ProfileReport", "profile", "compare", "measure_latencies", "register_macs_handler"]

MacsHandler = Callable[[nn.Module, torch.Tensor, torch.Tensor], int]


def _conv_macs(m: nn.Module, inp: torch.Tensor, out: torch.Tensor) -> int:
    """Each output element costs in_channels/groups * prod(kernel_size) MACs."""
    return out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)


def _conv_transpose_macs(m: nn.Module, inp: torch.Tensor, out: torch.Tensor) -> int:
    """Each input element is scattered to out_channels/groups * prod(kernel_size) outputs, one MAC each."""
    return inp.numel() * (m.out_channels // m.groups) * math.prod(m.kernel_size)


def _linear_macs(m: nn.Linear, inp: torch.Tensor, out: torch.Tensor) -> int:
    return out.numel() * m.in_features


_MACS_HANDLERS: dict[type[nn.Module], MacsHandler] = {
    nn.Conv1d: _conv_macs,
    nn.Conv2d: _conv_macs,
    nn.Conv3d: _conv_macs,
    Im2colConv2d: _conv_macs,  # our kernels' nn.Conv2d look-alikes
    DepthwiseConv2d: lambda m, inp, out: out.numel() * math.prod(m.kernel_size),
    nn.ConvTranspose1d: _conv_transpose_macs,
    nn.ConvTranspose2d: _conv_transpose_macs,
    nn.ConvTranspose3d: _conv_transpose_macs,
    nn.Linear: _linear_macs,
}


def _bias(m: nn.Module, inp: torch.Tensor, out: torch.Tensor) -> int:
    return out.numel() if getattr(m, "bias", None) is not None else 0


def _per_output(k: int) -> MacsHandler:
    return lambda m, inp, out: k * out.numel()


def _per_input(m: nn.Module, inp: torch.Tensor, out: torch.Tensor) -> int:
    return inp.numel()


def _stripe_conv_outputs(m: StripeConv2d, inp: torch.Tensor) -> int:
    """Elements of a StripeConv2d's conv output, before its pool (4x the pooled output only for even sizes)."""
    ho, wo = m.conv_out_size(inp.shape[2:])
    return inp.shape[0] * m.out_channels * ho * wo


# Extra MACs of the "paper" convention (ptflops style), added to the layer's own count.
_PAPER_EXTRA: dict[type[nn.Module], MacsHandler] = {
    nn.Conv1d: _bias, nn.Conv2d: _bias, nn.Conv3d: _bias, nn.Linear: _bias, Im2colConv2d: _bias, DepthwiseConv2d: _bias,
    nn.ConvTranspose1d: _bias, nn.ConvTranspose2d: _bias, nn.ConvTranspose3d: _bias,
    nn.BatchNorm1d: _per_output(2), nn.BatchNorm2d: _per_output(2), nn.BatchNorm3d: _per_output(2),
    nn.ReLU: _per_output(1), nn.ReLU6: _per_output(1), nn.LeakyReLU: _per_output(1), nn.PReLU: _per_output(1),
    ResidualReLU: _per_output(1),  # a PiX bottleneck's residual tail (the dense Bottleneck's ReLU module there)
    # a ReLU fused into its conv (compact(fuse_relu=True)) counts as it did as a module
    Conv2dReLU: lambda m, inp, out: _bias(m, inp, out) + out.numel(),
    # a StripeConv2d's bias adds as a Conv2d's, and a pool fused into it as nn.MaxPool2d (per input: the conv's
    # output), all on the conv's output before the pool
    StripeConv2d: lambda m, inp, out: _stripe_conv_outputs(m, inp) * (int(m.bias is not None) + int(m.relu)
                                                                       + int(m.pool)),
    nn.MaxPool1d: _per_input, nn.MaxPool2d: _per_input, nn.MaxPool3d: _per_input,
    nn.AvgPool1d: _per_input, nn.AvgPool2d: _per_input, nn.AvgPool3d: _per_input,
    nn.AdaptiveAvgPool1d: _per_input, nn.AdaptiveAvgPool2d: _per_input, nn.AdaptiveAvgPool3d: _per_input,
    nn.AdaptiveMaxPool1d: _per_input, nn.AdaptiveMaxPool2d: _per_input, nn.AdaptiveMaxPool3d: _per_input,
}
CONVENTIONS = ("layers", "paper")


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs[name]


def _convolution_macs(args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    """aten.convolution: as `_conv_macs` (transposed: as `_conv_transpose_macs`) from the weight's shape, (N, C/g, *k)
    (transposed: (C, N/g, *k))."""
    weight = _arg(args, kwargs, 1, "weight")
    scattered = _arg(args, kwargs, 0, "input") if _arg(args, kwargs, 6, "transposed") else out
    return scattered.numel() * math.prod(weight.shape[1:])


def _product_macs(first: int) -> Callable[[tuple, dict, torch.Tensor], int]:
    """A matrix product whose first factor, (..., K), is argument `first`: K MACs per output element."""
    return lambda args, kwargs, out: out.numel() * args[first].shape[-1]


def _attention_macs(args: tuple, kwargs: dict, out) -> int:
    """Fused attention of q (..., L, E), k (..., S, E), v (..., S, Ev): q @ k^T and the weights @ v."""
    q, k, v = args[:3]
    return q[..., 0].numel() * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def _kernel_conv_macs(args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    """compress::conv2d and compress::depthwise_conv2d: weight (N, C/g, kh, kw) ((C, 1, kh, kw) depthwise)."""
    return out.numel() * math.prod(args[1].shape[1:])


def _kernel_stripe_macs(args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    """compress::stripe_conv2d, out (B, N, Ho, Wo): each output position costs the kept stripes, weight (S, C)."""
    return out.shape[0] * out.shape[2] * out.shape[3] * args[1].numel()


_aten, _ours = torch.ops.aten, torch.ops.compress
# MACs of the aten ops (and of our kernels' ops) a forward may call itself, from their arguments and output
# (`_FunctionalMacs`)
_FUNCTIONAL_MACS = {
    _ours.conv2d: _kernel_conv_macs, _ours.depthwise_conv2d: _kernel_conv_macs,
    _ours.stripe_conv2d: _kernel_stripe_macs,
    _ours.pix_squeeze: lambda args, kwargs, out: pix_macs(args[0].shape, args[1].shape[0]),  # as PiXBlock.macs
    _ours.pix: lambda args, kwargs, out: args[0].numel(),  # the fusion alone: pix_macs' third term
    _aten.convolution: _convolution_macs,
    _aten.mm: _product_macs(0), _aten.bmm: _product_macs(0), _aten.mv: _product_macs(0),
    _aten.addmm: _product_macs(1), _aten.baddbmm: _product_macs(1), _aten.addmv: _product_macs(1),
    _aten.addbmm: lambda args, kwargs, out: args[1].numel() * args[2].shape[-1],  # a sum of the batch's products
    _aten.dot: lambda args, kwargs, out: args[0].numel(), _aten.vdot: lambda args, kwargs, out: args[0].numel(),
}
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class _FunctionalMacs(TorchDispatchMode):
    """Calls `add(macs)` for each convolution, matrix product (`_FUNCTIONAL_MACS`) and fused attention
    (`aten._scaled_dot_product_*`) dispatched while it is active. A composite op (F.conv2d, F.linear, matmul, einsum,
    which a forward's own inference_mode block dispatches whole) is run as its decomposition, whose ops come here in
    turn; each primitive is seen once, not the kernels it calls."""

    def __init__(self, add: Callable[[int], None]):
        super().__init__()
        self.add = add

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        formula = _FUNCTIONAL_MACS.get(packet)
        if formula is None and packet.__name__.startswith("_scaled_dot_product"):
            formula = _attention_macs
        if formula is None and func.has_kernel_for_dispatch_key(_COMPOSITE):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.add(int(formula(args, kwargs, out)))
        return out


def register_macs_handler(module_type: type[nn.Module], handler: MacsHandler) -> None:
    """Count modules of `module_type` (and its subclasses) with `handler(module, inp, out) -> MACs`.

    Prefer a `macs(self, inp, out)` method on your own modules; this is for types you cannot edit.
    """
    _MACS_HANDLERS[module_type] = handler


def _lookup(table: dict[type[nn.Module], MacsHandler], module: nn.Module) -> MacsHandler | None:
    for cls in type(module).__mro__:
        if cls in table:
            return table[cls]
    return None


def _handler(module: nn.Module, convention: str = "layers") -> MacsHandler | None:
    if callable(getattr(module, "macs", None)):
        base = lambda m, inp, out: m.macs(inp, out)  # noqa: E731
    else:
        base = _lookup(_MACS_HANDLERS, module)
    extra = _lookup(_PAPER_EXTRA, module) if convention == "paper" else None
    if base is None or extra is None:
        return base or extra
    return lambda m, inp, out: base(m, inp, out) + extra(m, inp, out)


def _covers_children(module: nn.Module) -> bool:
    """A module with `macs()`, or a parametrized layer (torch.nn.utils.parametrize on a conv, linear, BN: its weight
    lives in its `parametrizations` child), is one layer: its children get no rows of their own (a parametrized
    container's other children keep theirs)."""
    return callable(getattr(module, "macs", None)) or (parametrize.is_parametrized(module) and _handler(module) is not None)


def _is_profiled(module: nn.Module) -> bool:
    """Leaves, modules with `macs()`, and modules holding tensors of their own beside their children (timm's
    BatchNormAct2d, a block with a layer-scale gamma): their rows count only those tensors."""
    return len(module._modules) == 0 or _covers_children(module) or bool(_weight_tensors(module, recurse=False))


def _profiled_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that get a row, in model order, skipping the descendants of modules with `macs()`."""
    found, covered = [], []
    for name, m in model.named_modules():
        if any(c == "" or name.startswith(c + ".") for c in covered):  # "": the root has macs()
            continue
        if _is_profiled(m):
            found.append((name, m))
            if len(m._modules) and _covers_children(m):
                covered.append(name)
    return found


def _weight_tensors(module: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    """Parameters and persistent buffers of `module` (and of its children with `recurse`), minus BN's step counter."""
    tensors = list(module.parameters(recurse=recurse))
    for m in module.modules() if recurse else [module]:
        for bname, buf in m._buffers.items():
            if buf is None or bname in m._non_persistent_buffers_set or bname == "num_batches_tracked":
                continue
            tensors.append(buf)
    return list({id(t): t for t in tensors}.values())  # a tensor shared by modules once


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class LayerProfile:
    """One profiled layer: params (count), macs (multiply-adds), weight_bytes and activation_bytes
    (bytes of its new output tensor for one input; 0 for in-place ops and views), and latency_ms
    (median time between its forward pre-hook and hook at the profile's batch size: one call, so a module
    called k times per forward takes about k times that, while its macs and activation_bytes sum its calls)."""

    name: str
    type: str
    params: int
    macs: int
    weight_bytes: int
    activation_bytes: int
    output_shape: list[int]
    latency_ms: float | None = None


@dataclass
class ProfileReport:
    """Totals and per-layer rows for one input of shape `input_size` (C, H, W).

    `activation_bytes` = {"max": largest layer output, "sum": all new layer outputs} in bytes (a StripeConv2d
    that pools after its conv, anywhere but in the CUDA kernel's epilogue, counts that conv output too);
    `latency_ms` is the median forward time at `batch_size` on `device` (None when not measured);
    `convention` is how MACs were counted ("layers" or "paper", see the module docstring); `functional_macs`: the
    part of `macs` from convolutions and matrix products that forward code calls itself (module docstring).
    """

    input_size: list[int]
    params: int
    macs: int
    weight_bytes: int
    activation_bytes: dict[str, int]
    latency_ms: float | None
    device: str
    batch_size: int
    layers: list[LayerProfile] = field(default_factory=list)
    convention: str = "layers"
    functional_macs: int = 0

    def to_dict(self) -> dict:
        """JSON-ready dict with the totals and `layers` (a list of per-layer dicts)."""
        return asdict(self)

    def __str__(self) -> str:
        """The totals on a few lines (`print(profile(...))`); `layers` holds the per-layer rows."""
        size = "x".join(str(v) for v in self.input_size)
        latency = "not measured" if self.latency_ms is None else (
            f"{self.latency_ms:.3f} ms (median, batch {self.batch_size}, {self.device})")
        return "\n".join([
            f"profile of one {size} input ({len(self.layers)} layers, MACs by the {self.convention!r} convention)",
            f"  params            {self.params / 1e6:.3f} M",
            f"  MACs              {self.macs / 1e6:.2f} M" + (
                f" ({self.functional_macs / 1e6:.2f} M in ops forward code calls itself)" if self.functional_macs
                else ""),
            f"  weight bytes      {self.weight_bytes / 2**20:.2f} MiB",
            f"  activation bytes  {self.activation_bytes['max'] / 2**20:.2f} MiB largest, "
            f"{self.activation_bytes['sum'] / 2**20:.2f} MiB in all",
            f"  latency           {latency}",
        ])


def _storage_key(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (shared by its views and in-place results): the address of the storage object
    itself, not of its data, which is 0 for every tensor on the meta device (and for empty ones). `_cdata` is the
    address of the storage's C++ object, the handle PyTorch's own Python code uses for storage identity."""
    return t.untyped_storage()._cdata


def _count(model: nn.Module, x: torch.Tensor, convention: str = "layers") -> tuple[list[LayerProfile], int, int]:
    """Per-layer rows for one forward of `x` (a module called more than once sums its calls), the bytes of the
    largest single new output tensor, and the MACs of functional ops (`_FunctionalMacs`) among the rows'. Runs
    outside inference mode (no grad), where composite ops reach `_FunctionalMacs` already decomposed into the
    primitives it counts (it decomposes those a forward's own inference_mode block dispatches whole)."""
    rows: dict[str, LayerProfile] = {}
    largest = 0
    seen_storage: set[int] = set()
    counted_tensors: set[int] = set()  # ids of the weights a row holds: a tied one counts in its first row only
    keep_alive: list[torch.Tensor] = []  # holds outputs so a freed storage's address is not reused and miscounted
    running: list[str] = []  # the modules whose forward is running, innermost last
    in_counted = 0  # how many of them count their own work (a handler or macs()): ops inside are theirs
    functional: dict[str, int] = {}  # MACs of ops the forward of each module called itself, until it returns
    functional_total = 0

    def add_functional(macs: int) -> None:
        nonlocal functional_total
        if not in_counted:
            caller = running[-1] if running else ""  # none yet: a pre-hook of the model itself
            functional[caller] = functional.get(caller, 0) + macs
            functional_total += macs

    def pre(name: str, counted: bool):
        def fn(mod: nn.Module, inputs: tuple) -> None:
            nonlocal in_counted
            running.append(name)
            in_counted += counted

        return fn

    def post(name: str, counted: bool, handler: MacsHandler | None, profiled: bool):
        def fn(mod: nn.Module, inputs: tuple, kwargs: dict, out) -> None:
            nonlocal largest, in_counted
            if not running or running[-1] != name:  # its pre-hook never ran: an earlier pre-hook raised
                return
            running.pop()
            in_counted -= counted
            out_t = out if isinstance(out, torch.Tensor) else None
            extra = functional.pop(name, 0)
            if not (profiled or extra):
                return
            # the input: the first positional argument, or the first tensor passed by keyword (module(input=x))
            inp = inputs[0] if inputs else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            macs = int(handler(mod, inp, out_t)) if handler is not None and out_t is not None else 0
            act = 0
            if profiled and out_t is not None:
                key = _storage_key(out_t)
                if key not in seen_storage:
                    seen_storage.add(key)
                    # (at most its storage: an expanded view of a small new tensor allocates only that)
                    act = min(out_t.numel() * out_t.element_size(), out_t.untyped_storage().nbytes())
                    largest = max(largest, act)
                if isinstance(mod, StripeConv2d) and mod.pool and not mod.pools_in_kernel(inp):
                    # the full-size conv output it pools after (as the dense model's conv output before its pool)
                    pre = _stripe_conv_outputs(mod, inp) * out_t.element_size()
                    act, largest = act + pre, max(largest, pre)
                keep_alive.append(out_t)
            row = rows.get(name)
            if row is None:  # first call; a module called twice accumulates
                whole = len(mod._modules) == 0 or _covers_children(mod)  # else its children have rows
                # a module with a row only for the ops its forward calls itself counts no tensors (its children do)
                weights = [t for t in _weight_tensors(mod, recurse=whole) if id(t) not in counted_tensors] \
                    if profiled else []
                counted_tensors.update(id(t) for t in weights)
                rows[name] = LayerProfile(
                    name=name,
                    type=type(mod).__name__,
                    params=sum(t.numel() for t in weights if isinstance(t, nn.Parameter)),
                    macs=macs + extra,
                    weight_bytes=_nbytes(weights),
                    activation_bytes=act,
                    output_shape=list(out_t.shape) if out_t is not None else [],
                )
            else:
                row.macs += macs + extra
                row.activation_bytes += act

        return fn

    profiled = {name for name, _ in _profiled_modules(model)}
    handles = []
    for name, m in model.named_modules():
        counted = _handler(m) is not None  # the "layers" handler: its work includes the ops inside
        # the module's call is its forward alone: the user's hooks run outside it (their ops count as the caller's),
        # and the end of a call that raised is seen too (an exception caught further up)
        handles += [m.register_forward_pre_hook(pre(name, counted)),
                    m.register_forward_hook(post(name, counted, _handler(m, convention), name in profiled),
                                            prepend=True, always_call=True, with_kwargs=True)]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    try:
        # nn.MultiheadAttention's inference fast path is one fused op; without it, its products come here one by one
        torch.backends.mha.set_fastpath_enabled(False)
        with torch.inference_mode(False), torch.no_grad():
            x = x.clone()  # a normal tensor: the model may work on it in place
            seen_storage.add(_storage_key(x))
            with _FunctionalMacs(add_functional):
                model(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for h in handles:
            h.remove()
    return list(rows.values()), largest, functional_total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_latencies(models: Sequence[nn.Module], x: torch.Tensor, warmup: int = 3, repeats: int = 10) -> list[float]:
    """Median wall time (ms) of `model(x)` for each model, after `warmup` runs each (CUDA synchronised).

    The models are timed in turn within each repeat, so load changes on a shared machine hit them alike
    (side-by-side comparisons should use one call for all models)."""
    if repeats < 1:
        raise ValueError(f"measure_latencies: repeats must be >= 1, got {repeats}")
    for model in models:
        for _ in range(warmup):
            model(x)
    _sync(x.device)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for model, t in zip(models, times):
            start = time.perf_counter()
            model(x)
            _sync(x.device)
            t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def _layer_latency(model: nn.Module, x: torch.Tensor, repeats: int, names: set[str]) -> dict[str, float]:
    """Median forward time (ms) of the modules `names` (the report's rows) over `repeats` runs of `model(x)`."""
    times: dict[str, list[float]] = {}
    starts: dict[str, float] = {}

    def pre(name: str):
        def fn(mod, inputs) -> None:
            _sync(x.device)
            starts[name] = time.perf_counter()

        return fn

    def post(name: str):
        def fn(mod, inputs, out) -> None:
            _sync(x.device)
            times.setdefault(name, []).append((time.perf_counter() - starts[name]) * 1e3)

        return fn

    handles = []
    for name, m in model.named_modules():
        if name in names:
            handles += [m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post(name))]
    try:
        for _ in range(repeats):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return {name: statistics.median(t) for name, t in times.items()}


def _model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.device, t.dtype
    return torch.device("cpu"), torch.float32


@torch.inference_mode()
def profile(
    model: nn.Module,
    input_size: Sequence[int] = (3, 32, 32),
    batch_size: int = 1,
    device: str | torch.device | None = None,
    latency: bool = True,
    warmup: int = 3,
    repeats: int = 10,
    convention: str = "layers",
    memory_format: torch.memory_format = torch.contiguous_format,
) -> ProfileReport:
    """Profile `model` in eval mode on a random input (the mode is restored afterwards).

    Args:
        model: any nn.Module taking one (B, C, H, W) tensor.
        input_size: (C, H, W) of one input.
        batch_size: batch used for the latency measurements only; counts are for one input.
        device: where to run (default: the model's device); the model is moved there.
        latency: measure the median forward time (ms) over `repeats` runs after `warmup` runs, in
            total and then per layer (timed with hooks in `repeats` further runs).
        convention: "layers" (convs, Linear, custom `macs()`) or "paper" (also bias, BN, ReLU and
            pooling, ptflops style; see the module docstring).
        memory_format: of the random inputs (torch.channels_last to time a channels_last deployment).
    """
    with LIBRARY_LOCK:  # (see compress._modes.LIBRARY_LOCK)
        if convention not in CONVENTIONS:
            raise ValueError(f"profile: convention must be one of {CONVENTIONS}, got {convention!r}")
        check_module("profile", model)
        check_one_input("profile", model)
        if latency:  # (counts run on meta tensors: shapes are all they need)
            check_real("profile: latency=True", model, "pass latency=False to count MACs, parameters and bytes")
        input_size = chw("profile", input_size)
        if latency and (batch_size < 1 or repeats < 1 or warmup < 0):
            raise ValueError(f"profile: latency needs batch_size >= 1, repeats >= 1 and warmup >= 0; got batch_size="
                             f"{batch_size}, repeats={repeats}, warmup={warmup}")
        model_device, dtype = _model_device_dtype(model)
        device = torch.device(device) if device is not None else model_device
        model.to(device)
        with evaluating(model):
            gen = torch.Generator().manual_seed(0)  # a private generator: profiling never moves the global RNG
            x = torch.randn(1, *input_size, dtype=dtype, generator=gen, device="cpu").to(device, memory_format=memory_format)
            layers, largest, functional_macs = _count(model, x, convention)
            ms = None
            if latency:
                xb = torch.randn(batch_size, *input_size, dtype=dtype, generator=gen, device="cpu").to(device, memory_format=memory_format)
                (ms,) = measure_latencies([model], xb, warmup=warmup, repeats=repeats)
                per_layer = _layer_latency(model, xb, repeats, {row.name for row in layers})
                for row in layers:
                    row.latency_ms = per_layer.get(row.name)
        return ProfileReport(
            input_size=list(input_size),
            params=sum(p.numel() for p in model.parameters()),
            macs=sum(row.macs for row in layers),
            weight_bytes=_nbytes(_weight_tensors(model)),
            activation_bytes={"max": largest, "sum": sum(row.activation_bytes for row in layers)},
            latency_ms=ms,
            device=str(device),
            batch_size=batch_size,
            layers=layers,
            convention=convention,
            functional_macs=functional_macs,
        )


_COMPARED = (
    ("params", lambda r: r.params),
    ("macs", lambda r: r.macs),
    ("weight_bytes", lambda r: r.weight_bytes),
    ("activation_bytes_max", lambda r: r.activation_bytes["max"]),
    ("activation_bytes_sum", lambda r: r.activation_bytes["sum"]),
    ("latency_ms", lambda r: r.latency_ms),
)


def compare(dense: ProfileReport, compact: ProfileReport) -> list[dict]:
    """Side-by-side totals: rows {metric, dense, compact, ratio} with ratio = compact / dense
    (None when a value is missing or the dense value is 0)."""
    rows = []
    for metric, get in _COMPARED:
        d, c = get(dense), get(compact)
        ratio = c / d if d and c is not None else None
        rows.append({"metric": metric, "dense": d, "compact": c, "ratio": ratio})
    return rows

