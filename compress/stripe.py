"""StripeConv2d: the compact module of a stripe-pruned conv (SWP, "Pruning Filter in Filter").

A stripe is one filter's weights at one kernel offset across all input channels. A pruned conv keeps
S stripes: weight (S, C), the output channel of each stripe `out_index` (S,) and its (kh, kw) `offset`
(S, 2), both int64 buffers, in canonical order (sorted by offset, then output channel). The output is
the dense conv with every other stripe zeroed (semantics: shared/DESIGN.md "Stripe conv").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from compress.surgery import blank_conv, conv_like, uninitialised
from kernels import stripe_triton, unrolled
from kernels._utils import (
    autocast_dtype,
    autocast_inputs,
    contiguous_input,
    conv2d_relu,
    conv_out_size,
    eager_inference,
    fx_tracing,
    is_channels_last,
    needs_standard_ops,
    pair,
    recording,
    tensor_version,
    tracing_or_compiling,
)
from kernels.pool import max_pool2x2


def traced_stripe_conv2d(x: torch.Tensor, weight: torch.Tensor, out_index: torch.Tensor, offset: torch.Tensor,
                         bias: torch.Tensor | None, plan: torch.Tensor | None, out_channels: int, kernel_size, stride,
                         padding, dilation, relu: bool, pool: bool, pool_ceil: bool) -> torch.Tensor:
    """A StripeConv2d's forward as a torch.fx graph records it (arguments as the module's): `kernels.stripe_conv2d`
    (which casts under autocast, as the module's forward does) on a batched or unbatched x, then the 2x2 max-pool
    where `pool` is set."""
    if x.dim() == 3:
        return traced_stripe_conv2d(x.unsqueeze(0), weight, out_index, offset, bias, plan, out_channels, kernel_size,
                                    stride, padding, dilation, relu, pool, pool_ceil).squeeze(0)
    y = kernels.stripe_conv2d(x, weight, out_index, offset, bias, out_channels, kernel_size, stride, padding,
                              dilation, relu=relu, plan=plan)
    return max_pool2x2(y, pool_ceil) if pool else y


torch.fx.wrap("traced_stripe_conv2d")  # leaves in torch.fx graphs: they branch on the tensors
torch.fx.wrap("conv2d_relu")

__all__ = ["StripeConv2d", "Conv2dReLU", "conv2d_relu", "conv_padding", "masked_conv", "stripe_counts"]

MODES = ("stripe", "dense", "gemm")
# set after construction: the geometry rebuilds what depends on it, the epilogue drops the direct dense call
# (`StripeConv2d.__setattr__`)
_GEOMETRY = frozenset({"stride", "padding", "dilation"})
_EPILOGUE = frozenset({"relu", "pool", "pool_ceil"})


def _pair(v, name: str) -> tuple[int, int]:
    """An int or a pair of ints as a pair; a ValueError naming the argument otherwise (a string padding, a float,
    three values: an IndexError, a TypeError or a silent cut before)."""
    return tuple(pair(v, f"StripeConv2d: {name}"))


MAX_PLAN_ROWS = 2**24  # kernel area x output channels: the index table's size (ResNet-50's largest: 9 x 512)


def _check_geometry(conv: StripeConv2d) -> None:
    """ValueError unless the layer's sizes are those of a conv: channels >= 1, kernel, stride and dilation >= 1,
    padding >= 0, and a kernel area x output channels (the rows of its index table, built at load) of at most
    MAX_PLAN_ROWS, so that a compact file cannot make `load` allocate more than its tensors suggest."""
    named = {"in_channels": (conv.in_channels,), "out_channels": (conv.out_channels,), "kernel_size": conv.kernel_size,
             "stride": conv.stride, "dilation": conv.dilation}
    bad = [f"{name}={values}" for name, values in named.items() if min(values) < 1]
    bad += [f"padding={conv.padding}"] if min(conv.padding) < 0 else []
    rows = conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels
    bad += [f"kernel_size={conv.kernel_size} x out_channels={conv.out_channels} = {rows:,} index rows, above "
            f"{MAX_PLAN_ROWS:,}"] if rows > MAX_PLAN_ROWS else []
    if bad:
        raise ValueError(f"StripeConv2d: {'; '.join(bad)}: not the geometry of a conv layer (channels, kernel, stride "
                         "and dilation must be >= 1, padding >= 0); a compact file that names it is corrupt or "
                         "edited: export the model again")


def _sources(*tensors: torch.Tensor | None) -> tuple:
    """Detached views of the tensors a cache entry was built from: held with the entry, they keep those storages
    alive, so a cache key of storage address and version can never match a later tensor at a reused address."""
    return tuple(None if t is None else t.detach() for t in tensors)


@contextlib.contextmanager
def _building_a_cache():
    """Autograd off, and new tensors normal ones, not inference tensors: a weight cache built under
    torch.inference_mode then also serves a later call that autograd records (an input gradient through frozen
    weights), which cannot save an inference tensor for backward. (inference_mode(False) turns grad mode on: the
    no_grad comes inside it.)"""
    with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
        with torch.no_grad():
            yield


def _layout(x: torch.Tensor) -> torch.memory_format:
    """channels_last if x is stored channels_last, as torch's suggest_memory_format decides: also a 1-channel
    tensor made channels_last (channel stride 1, ambiguous by shape alone), so that a shrunk 1-channel layer
    does not turn the rest of a channels_last network NCHW; else contiguous NCHW."""
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        return torch.contiguous_format
    if is_channels_last(x) or (x.shape[1] == 1 and x.stride(1) == 1 and x.shape[2] * x.shape[3] > 1):
        return torch.channels_last
    return torch.contiguous_format


class Conv2dReLU(nn.Conv2d):
    """An nn.Conv2d and the ReLU after it as one module (same parameters and state dict as the conv), made by
    `compress.compact(..., fuse_relu=True)`; see `conv2d_relu`."""

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> Conv2dReLU:
        new = blank_conv(cls, conv)
        new.load_state_dict(conv.state_dict())
        new.train(conv.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            return F.relu(super().forward(x))
        return conv2d_relu(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", relu=True"


def stripe_padding_ok(conv: nn.Conv2d) -> bool:
    """Whether a StripeConv2d can express `conv`'s padding (`conv_padding` does not raise)."""
    try:
        conv_padding(conv)
    except ValueError:
        return False
    return True


def conv_padding(conv: nn.Conv2d) -> tuple[int, int]:
    """The symmetric (ph, pw) zero padding of `conv`, resolving 'valid' and symmetric 'same'."""
    if conv.padding_mode != "zeros":
        raise ValueError(
            f"padding_mode={conv.padding_mode!r} is not supported by stripe compaction; use 'zeros' "
            "or exclude this conv from attach_skeletons"
        )
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if any(t % 2 for t in total):
            raise ValueError(
                f"padding='same' with kernel {conv.kernel_size} and dilation {conv.dilation} pads "
                "asymmetrically; use explicit symmetric padding for stripe compaction"
            )
        return (total[0] // 2, total[1] // 2)
    return _pair(conv.padding, "padding")


@torch.no_grad()
def masked_conv(conv: nn.Conv2d, threshold: float) -> nn.Conv2d:
    """The plain nn.Conv2d equal to SkeletonConv2d `conv` with the stripes |skeleton| <= threshold dropped:
    weight W * skeleton * mask (zeros where dropped); same arguments, bias, device, dtype, mode."""
    dense = blank_conv(nn.Conv2d, conv)
    dense.weight.copy_(conv.weight * (conv.stripe_scale() * conv.stripe_mask(threshold))[:, None])
    if conv.bias is not None:
        dense.bias.copy_(conv.bias)
    return conv_like(dense, conv)


class StripeConv2d(nn.Module):
    """Conv with only the kept stripes: x (B, C, H, W) -> y (B, N, Ho, Wo), Ho/Wo as the source conv.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation: as in nn.Conv2d
            (groups 1, zero padding, ints or pairs).
        num_stripes: S, the number of kept stripes (the module starts empty: zero weight and indices;
            fill it with `from_skeleton`/`from_dense` or `load_state_dict`).
        bias: whether there is a bias (N,).
        mode: "stripe" runs `kernels.stripe_conv2d` on the kept stripes; "dense" runs F.conv2d with the
            zero-filled dense weight (cached in eval; cut to the centred window of offsets that holds every kept
            stripe, so a 3x3 layer left with centre stripes only runs as a 1x1 conv); "gemm" runs the conv as
            one GEMM with the weight unrolled over the whole input image (`kernels.unrolled`, cached per input
            size), for tiny feature maps (a VGG's 2x2 and 4x4 layers), and dense mode where
            `kernels.unrolled.fits` rules it out for the input or autograd records. All give the same output;
            `compress.compact` sets a cost-model choice and `compress.choose_modes` the fastest measured. It is
            an inference choice: eager and compiled training steps on CUDA run dense mode (see
            `_cuda_training_in_dense_mode`).
        relu: apply ReLU to the output, in the kernel's epilogue (stripe mode) or cuDNN's (dense mode, see
            `conv2d_relu`); set by `compress.compact(..., fuse_relu=True)` for a conv whose BN is folded and
            whose only consumer is a ReLU.
        pool: then a 2x2 max-pool, stride 2 (`F.max_pool2d(y, 2, ceil_mode=pool_ceil)`): in the kernel's epilogue
            for even Ho and Wo (`kernels.prepare_stripe_conv2d`), so the full-size output is never written, else
            `F.max_pool2d` after; set by
            `compress.compact(..., fuse_relu=True)` where such a pool module is the fused ReLU's only consumer
            (VGG). cuDNN has no pooling epilogue: dense mode pools after.
        pool_ceil: the pool's ceil_mode (odd sizes keep their last row and column).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        num_stripes: int = 0,
        bias: bool = False,
        mode: str = "stripe",
        relu: bool = False,
        pool: bool = False,
        pool_ceil: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        flags = {"bias": bias, "relu": relu, "pool": pool, "pool_ceil": pool_ceil}
        bad = [f"{name}={value!r}" for name, value in flags.items() if not isinstance(value, bool)]
        if bad:  # (bool() would take "no" as True; a compact file's recipe holds true/false)
            raise TypeError(f"StripeConv2d: {', '.join(bad)}: must be True or False")
        self.relu, self.pool, self.pool_ceil = relu, pool, pool_ceil
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride = _pair(kernel_size, "kernel_size"), _pair(stride, "stride")
        self.padding, self.dilation = _pair(padding, "padding"), _pair(dilation, "dilation")
        _check_geometry(self)
        self.mode = mode
        self.weight = nn.Parameter(torch.zeros(num_stripes, in_channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_channels, device=device, dtype=dtype)) if bias else None
        self.register_buffer("out_index", torch.zeros(num_stripes, dtype=torch.long, device=device))
        self.register_buffer("offset", torch.zeros(num_stripes, 2, dtype=torch.long, device=device))
        # kernels.stripe_plan of the indices; built once they are set (from_dense, load_state_dict)
        self.register_buffer("plan", None, persistent=False)
        # kernels.stripe_rows of the indices (where dense_weight scatters each stripe), built with the plan
        self.register_buffer("rows", None, persistent=False)
        self._dense_cache: tuple[tuple, torch.Tensor] | None = None
        self._gemm_cache: tuple[tuple, tuple] | None = None  # (key, (unrolled weight, bias rows, (Ho, Wo)))
        self._trim = (0, 0)  # kernels.dense_trim of the indices: rings of offsets dense mode leaves out
        self._tile_keep: dict[int, float] | None = None  # kernels.stripe_tile_keep of the plan (_build_plan)
        self._trim_cache: tuple | None = None  # (the dense weight it was cut from, (cut weight, padding))
        self._launch_cache: tuple | None = None  # (key, launcher or None, relayout): _inference_launch
        self._eager_dense: tuple | None = None  # `_eager_dense_output`'s (layout, weight, its data_ptr and version,
        # bias, the call `_direct_dense` bound to them)
        self._indexed: tuple | None = None  # (out_index, offset, plan): the tensors the plan was built from
        # (`_check_indexed`)
        self._op_trained: set[tuple] = set()  # inputs an eager training step ran the op for
        # (_cuda_training_in_dense_mode)

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"StripeConv2d: mode must be one of {MODES}, got {value!r}")
        self._mode = value
        self._eager_dense = None

    @property
    def num_stripes(self) -> int:
        return self.weight.shape[0]

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, conv: nn.Conv2d, mask: torch.Tensor, mode: str = "stripe") -> StripeConv2d:
        """Keep the stripes of `conv` where `mask` (bool, (N, kh, kw)) is True; weight and bias copied."""
        if not isinstance(conv, nn.Conv2d):  # (a ConvTranspose2d, Conv1d or Linear failed on an index or unpacking)
            raise TypeError(f"StripeConv2d.from_dense: expected an nn.Conv2d, got {type(conv).__name__}")
        if conv.groups != 1:
            raise ValueError(f"StripeConv2d: only groups=1 convs can be compacted, got groups={conv.groups}")
        kh, kw = conv.kernel_size
        if mask.shape != (conv.out_channels, kh, kw) or mask.dtype != torch.bool:
            raise ValueError(
                f"StripeConv2d.from_dense: mask must be bool of shape {(conv.out_channels, kh, kw)}, "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        # canonical order: by offset (kh, kw), then output channel
        offset_major = mask.detach().to(conv.weight.device).permute(1, 2, 0)  # (kh, kw, N)
        i, j, o = offset_major.nonzero(as_tuple=True)
        new = cls(
            conv.in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv_padding(conv),
            conv.dilation,
            num_stripes=o.numel(),
            bias=conv.bias is not None,
            mode=mode,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )
        with torch.no_grad():
            new.weight.copy_(conv.weight[o, :, i, j])
            new.out_index.copy_(o)
            new.offset.copy_(torch.stack([i, j], dim=1))
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
        new._build_plan()
        return conv_like(new, conv)

    @classmethod
    def from_skeleton(cls, conv: nn.Conv2d, threshold: float, mode: str = "stripe") -> StripeConv2d:
        """From a SkeletonConv2d: stripes where |skeleton| > threshold, weight W * skeleton (ValueError for a
        skeleton with NaN or inf values, or a threshold that is not a number >= 0)."""
        conv.check_finite("StripeConv2d.from_skeleton")
        return cls.from_dense(masked_conv(conv, threshold), conv.stripe_mask(threshold), mode=mode)

    def dense_weight(self, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        """The zero-filled dense weight (N, C, kh, kw) laid out as `memory_format`; differentiable w.r.t. `weight`."""
        return kernels.stripe_to_dense(
            self.weight, self.out_index, self.offset, self.out_channels, self.kernel_size, memory_format,
            rows=self.rows,
        )

    def to_dense(self) -> nn.Module:
        """An nn.Conv2d (a Conv2dReLU if `relu`; in nn.Sequential with its nn.MaxPool2d if `pool`) with the same
        output: dropped stripes are zeros."""
        conv = uninitialised(
            Conv2dReLU if self.relu else nn.Conv2d,
            self.in_channels,
            self.out_channels,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(self.dense_weight())
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        conv_like(conv, self)
        return nn.Sequential(conv, nn.MaxPool2d(2, ceil_mode=self.pool_ceil)).train(self.training) if self.pool else conv

    def stripe_mask(self) -> torch.Tensor:
        """Bool (N, kh, kw): True where a stripe is kept."""
        mask = torch.zeros(
            self.out_channels, *self.kernel_size, dtype=torch.bool, device=self.out_index.device
        )
        mask[self.out_index, self.offset[:, 0], self.offset[:, 1]] = True
        return mask

    # ---- forward --------------------------------------------------------------------------------
    def _cached_dense_weight(self, fmt: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        """The zero-filled dense weight laid out as `fmt` (the input's layout: a channels_last conv would
        otherwise copy an NCHW weight on every call; the exact strides hold also for 1-channel weights, whose
        layout is ambiguous by shape), cached in eval / without grad; built anew (two small kernels for
        channels_last) while training."""
        w = self.weight
        if recording(w) or tracing_or_compiling():  # a tracer or compiler gets the build in its graph
            return self.dense_weight(fmt)
        # cheap key (this runs on every eager call): the weight's storage and version (a move or cast makes a new
        # tensor), the indices' storage; _build_plan (new indices from a state dict) clears the cache. The cache
        # holds the weight it was built from, so that a weight assigned later (`.data =`, a new Parameter) cannot
        # get its freed address and pass for it.
        key = (fmt, w.data_ptr(), tensor_version(w), self.out_index.data_ptr())
        cache = self._dense_cache  # read once: another thread may replace it (threads serving one model)
        if cache is None or cache[0] != key:
            with _building_a_cache():
                self._dense_cache = cache = (key, self.dense_weight(fmt), _sources(w))
        return cache[1]

    def _dense_mode_weight(self, fmt: torch.memory_format) -> tuple[torch.Tensor, tuple[int, int]]:
        """(weight, padding) of dense mode: the zero-filled weight cut to the centred window of offsets that holds
        every kept stripe (`kernels.dense_trim`, e.g. a 3x3 layer with only centre stripes runs as a 1x1 conv),
        the padding reduced to match; kept with the dense weight in eval."""
        w = self._cached_dense_weight(fmt)
        if not any(self._trim):
            return w, self.padding
        if recording(self.weight) or tracing_or_compiling():
            return kernels.trimmed_dense(w, self._trim, self.padding, self.dilation, fmt)
        cache = self._trim_cache  # read once (threads: see _cached_dense_weight)
        if cache is None or cache[0] is not w:
            with _building_a_cache():
                self._trim_cache = cache = (w, kernels.trimmed_dense(w, self._trim, self.padding, self.dilation, fmt))
        return cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) -> (B, N, Ho, Wo), in x's layout (see `_layout`); an unbatched x (C, H, W) -> (N, Ho, Wo),
        as nn.Conv2d. Any strides: an x that is neither contiguous NCHW nor channels_last (a channel slice) is
        copied first.

        Under torch.fx symbolic tracing (torchvision's create_feature_extractor) the layer records one
        `traced_stripe_conv2d` call (the kernel on CUDA, the stripe GEMM on CPU), not the mode chosen per call here,
        whose choice reads the input."""
        if fx_tracing():
            return traced_stripe_conv2d(x, self.weight, self.out_index, self.offset, self.bias, self.plan,
                                        self.out_channels, self.kernel_size, self.stride, self.padding, self.dilation,
                                        self.relu, self.pool, self.pool_ceil)
        y = self._eager_dense_output(x)
        if y is not None:
            return y
        self._check_indexed()
        if x.dim() == 3 and x.shape[0] == self.in_channels:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        if x.dim() != 4 or (not torch.jit.is_tracing() and x.shape[1] != self.in_channels):
            raise ValueError(f"StripeConv2d: expected input (B, {self.in_channels}, H, W) or ({self.in_channels}, "
                             f"H, W), got {tuple(x.shape)}; the layer was compacted from a conv with "
                             f"{self.in_channels} input channels")
        if self.plan is None and self.num_stripes:
            raise RuntimeError(f"StripeConv2d: its {self.num_stripes} stripes were never set (a layer built with "
                               "num_stripes=S holds placeholders); fill it with load_state_dict, or build it with "
                               "StripeConv2d.from_dense / from_skeleton")
        # torch.func.grad / vmap / jacrev, dual tensors: the ops below have no functorch or forward-mode rules; a
        # plain torch.onnx.export (either exporter): ONNX has no stripe conv (compress.onnx_export has more choices)
        if needs_standard_ops() or (tracing_or_compiling() and torch.onnx.is_in_onnx_export()):
            conv = conv2d_relu if self.relu else F.conv2d
            return self._pooled(conv(x, self.dense_weight(), self.bias, self.stride, self.padding, self.dilation))
        x = contiguous_input(x)
        kept = self._inference_launch(x)
        if kept is not None:  # eager CUDA inference in stripe mode: checked first, the path whose host time counts
            launch, relayout = kept[1], kept[2]
            y = launch.run(x)  # pooled by the launcher; x has its signature (the key)
            return y.contiguous(memory_format=torch.channels_last) if relayout else y
        fmt = _layout(x)
        if self._no_stripe() and self._constant_applies(x):
            out = self._constant_output(x, fmt)
            return self._pooled(out.relu_() if self.relu else out)
        if self._mode == "gemm":
            (xg,) = autocast_inputs(x)  # the GEMM in the autocast dtype, as F.conv2d would run
            if self._gemm_fits(xg):
                return self._pooled(unrolled.unrolled_conv2d(xg, *self._cached_unrolled(xg), relu=self.relu,
                                                             memory_format=fmt))
        # (where the kernel does not run on CUDA: float64, float32 with TF32 turned off, no Triton: cuDNN, not the
        # op's PyTorch path of a GEMM and a scatter per offset; a compiled graph keeps the op, which checks that itself)
        if self._mode != "stripe" or self._cuda_training_in_dense_mode(x) \
                or (x.is_cuda and not tracing_or_compiling() and not stripe_triton.available(x)):
            conv = conv2d_relu if self.relu else F.conv2d
            w, pad = self._dense_mode_weight(fmt)
            if self._mode == "dense" and eager_inference():  # (the condition `_eager_dense_output` runs under)
                weight = self.weight
                self._eager_dense = (fmt, weight, weight.data_ptr(), tensor_version(weight), self.bias,
                                     self._direct_dense(w, pad))
            return self._pooled(conv(x, w, self.bias, self.stride, pad, self.dilation))
        args, kwargs = self._op_arguments(x)
        y = self._pooled(kernels.stripe_conv2d(*args, **kwargs))
        if fmt is torch.channels_last and not y.is_contiguous(memory_format=fmt):
            y = y.contiguous(memory_format=fmt)  # a 1-channel channels_last x counts as NCHW for the op
        return y

    def _eager_dense_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """Dense mode's output in plain eager inference (`eager_inference`), through the call `_direct_dense` bound
        for x's layout and the current weight; None elsewhere (the general path runs).
        Why: on a CPU a small layer's own conv takes tens of us, and every Python step of a call counts: with the
        general path's checks and cache keys a compact ResNet-20 whose layers all chose dense mode ran 0.84x its
        dense model at batch 1, with a first direct path that looked up its arguments and called helpers 0.93-0.95x,
        with this one 0.98x, and at batch 16 0.94-0.99x -> 1.00-1.02x (1 thread; per-run medians in
        benchmarks/results/stripe_dense_mode_eager_cpu_session39.txt)."""
        kept = self._eager_dense
        if kept is None or not eager_inference():
            return None
        fmt, weight, ptr, version, bias, call = kept
        params = self._parameters  # (module attribute lookup of a parameter takes ~1 us)
        # .get: torch.nn.utils.prune and parametrizations take the names out of _parameters
        now = params.get("weight")
        if (now is not weight or now.data_ptr() != ptr or (version >= 0 and now._version != version)
                or params.get("bias") is not bias):  # (a bias swapped in any way: functional_call, parametrized)
            return None
        if fmt is torch.contiguous_format:
            if not x.is_contiguous():  # (a contiguous 4-D x is NCHW to `_layout`; else the general path copies x)
                return None
        elif _layout(x) is not fmt:
            return None
        try:
            return call(x)
        except RuntimeError:  # a wrong input: the general path names it (and an unbatched x runs there)
            return None

    def _direct_dense(self, w: torch.Tensor, pad: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
        """x -> dense mode's output from the kept weight and padding (`_dense_mode_weight`) with every other
        argument bound now, for `_eager_dense_output` (which checks the bias is still the one bound; setting an
        attribute of the geometry or the epilogue drops the call, `__setattr__`)."""
        bias, stride, dilation, ceil = self.bias, self.stride, self.dilation, self.pool_ceil
        if self.relu and w.is_cuda:
            def conv(x: torch.Tensor) -> torch.Tensor:
                return conv2d_relu(x, w, bias, stride, pad, dilation)  # cuDNN's fused conv + bias + ReLU
        elif self.relu:
            def conv(x: torch.Tensor) -> torch.Tensor:
                return F.conv2d(x, w, bias, stride, pad, dilation).relu_()  # conv2d_relu off CUDA, a frame less
        else:
            def conv(x: torch.Tensor) -> torch.Tensor:
                return F.conv2d(x, w, bias, stride, pad, dilation)
        return (lambda x: max_pool2x2(conv(x), ceil)) if self.pool else conv

    def __setattr__(self, name: str, value) -> None:
        """As nn.Module's; after construction, setting stride, padding or dilation checks the new geometry and
        rebuilds what depends on it (dense mode's trim, every kept weight and call), setting relu, pool or
        pool_ceil drops the direct dense call that bound them, and setting out_index or offset drops every kept
        weight and call (the next forward refuses indices the plan was not built from: `_check_indexed`)."""
        built = "_op_trained" in self.__dict__  # (__init__ sets it last)
        if not (built and name in _GEOMETRY):
            super().__setattr__(name, value)
            if built and name in _EPILOGUE:
                self._eager_dense = None
            if built and name in ("out_index", "offset"):  # (the next call checks them: `_check_indexed`)
                self._drop_caches()
            return
        old = self.__dict__[name]
        super().__setattr__(name, _pair(value, name))
        try:
            _check_geometry(self)
        except ValueError:
            super().__setattr__(name, old)
            raise
        if self.plan is not None:
            self._trim = kernels.dense_trim(self.offset, self.kernel_size, self.padding, self.dilation)
        self._drop_caches()

    def _gemm_fits(self, x: torch.Tensor) -> bool:
        """Whether gemm mode runs its GEMM on `x`: the unrolled weight fits (`kernels.unrolled.fits`), autograd
        does not record (the weight is unrolled without grad; a training step runs dense mode) and no tracer or
        compiler is looking (they get dense mode, not the unrolling loop)."""
        return not (recording(x, self.weight, self.bias) or tracing_or_compiling()) and x.shape[0] > 0 and unrolled.fits(
            self.in_channels, self.out_channels, x.shape[2:], self.kernel_size, self.stride, self.padding,
            self.dilation, x.element_size())

    def _cached_unrolled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]:
        """(unrolled weight, bias per output row or None, (Ho, Wo)) for inputs of x's size, dtype and device, kept
        until the weight or the input size changes (`kernels.unrolled`)."""
        key = (tuple(x.shape[2:]), x.dtype, x.device, self.out_index.data_ptr()) + tuple(
            None if t is None else (t.data_ptr(), tensor_version(t))
            for t in (self.weight, self.bias))
        cache = self._gemm_cache  # read once: another thread may replace it with another input size's entry
        if cache is None or cache[0] != key:
            with torch.no_grad():
                self._gemm_cache = cache = (key, unrolled.unrolled_operands(
                    self.dense_weight().to(x.dtype), self.bias, x.shape[2:], self.stride, self.padding, self.dilation),
                    _sources(self.weight, self.bias))  # held: see _cached_dense_weight
        return cache[1]

    def pools_in_kernel(self, x: torch.Tensor) -> bool:
        """Whether a forward on `x` max-pools in the stripe kernel's epilogue, never writing the full-size conv
        output (eager CUDA inference in stripe mode, even output sizes); elsewhere a pooling layer writes its conv
        output and pools it after (what `compress.profile` counts)."""
        if not self.pool:
            return False
        kept = self._inference_launch(contiguous_input(x))
        return kept is not None and kept[1].pool_fused

    def _pooled(self, y: torch.Tensor) -> torch.Tensor:
        return max_pool2x2(y, self.pool_ceil) if self.pool else y

    def _cuda_training_in_dense_mode(self, x: torch.Tensor) -> bool:
        """Whether this call is a training step on CUDA (autograd recording, no CUDA graph being captured, not
        traced by TorchScript) that runs as dense mode: cuDNN with the zero-filled weight built for the step.

        `mode` is an inference choice; in a training step the op's host cost (dispatch, checks, Triton launches
        in the forward and the backward) exceeds a small layer's GPU time: about 0.35 ms more per stripe layer and
        step than cuDNN on an H200 host. Measured, a CIFAR ResNet-56 (random masks, 46 of 55 layers in stripe
        mode) stepped in 12.1 + 20.2 ms (forward + backward) through the kernel even with a kept forward launcher,
        7.2 + 9.1 ms through cuDNN (benchmarks/results/stripe_models_gpu_h200_train_eager_{kernel,cudnn}.json).
        torch.compile keeps that host cost (the op is opaque to it): with the kernel, compiled ResNet-56 and VGG16
        steps took 61.0 and 7.0 ms against 7.0 and 3.0 ms for their compiled dense models
        (stripe_models_gpu_h200_train_compile_kernel.json), so compiled steps take dense mode too. Steps captured in
        CUDA graphs (`torch.cuda.make_graphed_callables`) keep the kernel and its Triton backward, where only GPU
        time counts. So that such a capture finds the kernels compiled (Triton cannot load a kernel while a stream
        captures), the first eager step per input shape and autocast dtype still runs the op: the warm-up steps
        before a capture do that."""
        if not (x.is_cuda and recording(x, self.weight, self.bias)):
            return False
        if torch.compiler.is_compiling():  # (checked first: the capture query below is a graph break for dynamo)
            return True
        if torch.cuda.is_current_stream_capturing() or torch.jit.is_tracing():
            return False
        key = (stripe_triton.input_signature(x), autocast_dtype("cuda"))
        if key not in self._op_trained:
            self._op_trained.add(key)
            return False
        return True

    def _op_arguments(self, x: torch.Tensor) -> tuple[tuple, dict]:
        """(args, kwargs) of `kernels.stripe_conv2d` (and `prepare_stripe_conv2d`) for this layer on `x`."""
        args = (x, self.weight, self.out_index, self.offset, self.bias, self.out_channels, self.kernel_size,
                self.stride, self.padding, self.dilation)
        return args, {"relu": self.relu, "plan": self.plan, "dense": self._kernel_dense_weight(x)}

    def _kernel_dense_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The zero-filled channels_last dense weight for the CUDA kernel's dense route (narrow or dense-ish layers),
        where the route reads it: in inference from the same cache as the dense mode instead of being rebuilt on
        every call; in training built once per call here (the op takes no gradient through it), so the route runs
        as in inference. None elsewhere (the op then decides)."""
        if not (
            x.is_cuda
            and not tracing_or_compiling()
            and kernels.stripe_reads_dense(x, self.weight, self.out_channels, self.kernel_size, self.stride,
                                           self.padding, self.dilation, self._inference_tile_keep())
        ):
            return None
        if recording(self.weight):
            with torch.no_grad():
                return self.dense_weight(torch.channels_last)
        return self._cached_dense_weight(torch.channels_last) if self.weight.dtype == x.dtype else None

    @property
    def tile_keep(self) -> dict[int, float] | None:
        """`kernels.stripe_tile_keep` of the plan: per tile width, the share of the kernel offsets tiles of output
        channels keep (near 1 for per-filter masks; low where groups of filters share their stripes)."""
        return self._tile_keep

    def _inference_tile_keep(self) -> dict[int, float] | None:
        """`kernels.stripe_tile_keep` of this layer's plan (found in `_build_plan`) for the eager inference launcher,
        whose route may then skip the kernel offsets a tile of output channels keeps no stripe of; None while
        autograd records (the op then chooses its route without it, as in training)."""
        return None if recording(self.weight) else self._tile_keep

    def _inference_launch(self, x: torch.Tensor) -> tuple | None:
        """(key, launcher, relayout) for `x` in eager CUDA inference in stripe mode: the kernel launcher
        (`kernels.prepare_stripe_conv2d`) kept per input signature and weight version, and whether its output must
        be made channels_last (a 1-channel channels_last x, which the op reads as NCHW). None where the op or
        another mode must run: not stripe mode, no stripe, autograd recording, autocast to another dtype, tracing
        or compiling, or no Triton kernel for `x`.

        Why: an eager call through the op spends most of its time on the host (dispatch, argument checks, route
        choice, Triton's per-call JIT binding), several times the GPU time of a small layer; the launcher does that
        work once per input shape (host time per call 103-112 -> 21 us on an H200 host, that of a cuDNN conv;
        benchmarks/results/stripe_eager_gpu_h200.json). The checks here run on every eager call, so they are
        ordered cheapest first, and the key holds only what can change without `_build_plan` (which drops the
        launcher): the input, the weight and bias storage and version (`.to()` and in-place edits), the epilogue
        flags. The indices move only with the weight (`.to()`/`.cuda()`) or through `_build_plan`."""
        if self._mode != "stripe" or not x.is_cuda:
            return None
        w, b = self.weight, self.bias
        if recording(x, w, b) or tracing_or_compiling() or not stripe_triton.available(x):
            return None
        if w.dtype != x.dtype or autocast_dtype("cuda") not in (None, x.dtype):
            return None
        key = (
            stripe_triton.input_signature(x),
            w.data_ptr(),
            tensor_version(w),
            None if b is None else (b.data_ptr(), tensor_version(b)),
            self.relu,
            self.pool,
            self.pool_ceil,
        )
        cache = self._launch_cache
        if cache is None or cache[0] != key:
            launch = None  # kept for a layer with no stripe too: forward's constant output, without a rebuild per call
            if self.num_stripes:
                args, kwargs = self._op_arguments(x)
                launch = kernels.prepare_stripe_conv2d(*args, **kwargs, pool=self.pool, pool_ceil=self.pool_ceil,
                                                       tile_keep=self._inference_tile_keep())
            relayout = _layout(x) is torch.channels_last and not is_channels_last(x)
            self._launch_cache = cache = (key, launch, relayout, _sources(w, b))  # held: see _cached_dense_weight
        return None if cache[1] is None else cache

    def graph_keepalive(self) -> tuple:
        """What a CUDA graph captured through this module reads besides its parameters and buffers: the kept dense
        weight (and its cut window, dense mode), the unrolled weight (gemm mode) and the launcher
        (`compress.CUDAGraphModel` holds them while the graph lives, so a later call with another input layout or
        size, which replaces them, cannot free memory the graph reads)."""
        return self._dense_cache, self._trim_cache, self._gemm_cache, self._launch_cache, self._eager_dense

    def _check_indexed(self) -> None:
        """ValueError when `out_index` or `offset` is not the tensor the plan was built from while the plan is
        (torch.func.functional_call with another layer's state dict, or an assignment `layer.out_index = ...`): the
        plan, `rows` and the kept weights would still place the old indices' stripes, a silently wrong output. A
        call that swaps in the plan and rows too (functional_call with `named_buffers()`) takes them as given."""
        indexed, buffers = self._indexed, self._buffers
        if indexed is not None and buffers["plan"] is indexed[2] and (
                buffers["out_index"] is not indexed[0] or buffers["offset"] is not indexed[1]):
            raise ValueError(
                "StripeConv2d: its out_index/offset are not the tensors its index plan was built from (functional_call"
                " or an assignment with other indices); the plan would place the old stripes. Load other indices "
                "with load_state_dict, which rebuilds the plan, or pass functional_call the layer's own indices (or "
                "its plan and rows buffers too)")

    def _apply(self, fn, recurse: bool = True):
        """As nn.Module's (.to, .cuda, .half: new index tensors), and the plan's record follows them."""
        out = super()._apply(fn, recurse)
        if self._indexed is not None:
            self._indexed = (self.out_index, self.offset, self.plan)
        return out

    def _drop_caches(self) -> None:
        self._dense_cache = self._trim_cache = self._gemm_cache = self._launch_cache = self._eager_dense = None

    def train(self, mode: bool = True) -> StripeConv2d:
        """Also drops the kept weights (dense, unrolled, launcher): writes that bypass a tensor's version counter
        (`.data`, fused optimizers such as `SGD(fused=True)`, in-place writes to inference tensors, which have no
        version) leave the cache keys unchanged, so a switch to or from
        eval, as every training loop makes, rebuilds them from the current weights. Such a write made in eval shows
        after the next `train()`/`eval()`."""
        self._drop_caches()
        return super().train(mode)

    def __getstate__(self) -> dict:
        """Copies and pickles drop the kept weights and launcher (a launcher holds a compiled kernel, and a cache key
        a memory format, which torch.save cannot pickle; all are rebuilt on first use) and forget which inputs an
        eager training step ran the op for (a copy in another process has compiled nothing)."""
        state = dict(super().__getstate__())
        state.update(_dense_cache=None, _trim_cache=None, _gemm_cache=None, _launch_cache=None, _eager_dense=None,
                     _op_trained=set())
        return state

    def _no_stripe(self) -> bool:
        """Whether the layer kept no stripe. Under torch.jit.trace the weight's size is a traced tensor, whose
        comparison warns that the trace fixes its value: the stripe count is the module's structure, which a trace
        fixes anyway, so it is read without that TracerWarning."""
        if not torch.jit.is_tracing():
            return self.num_stripes == 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return bool(self.num_stripes == 0)

    def _constant_applies(self, x: torch.Tensor) -> bool:
        """Whether a layer with no stripe may output its bias from x's shape alone, as F.conv2d on its zero weight
        would give: autograd does not record x (under torch.jit.trace whatever it records, so that the traced graph
        does not depend on the grad mode: its check re-runs it; x then gets no gradient here instead of zeros), no
        autocast to another dtype, x of the weight's dtype, at least one output pixel. Elsewhere the mode's path runs
        on the empty stripe set, with F.conv2d's gradient for x (zeros), dtypes and errors."""
        tracing = torch.jit.is_tracing()  # (its sizes are tensors: comparing them would warn)
        recorded = x.requires_grad and torch.is_grad_enabled() and not tracing
        return (not recorded and x.dtype == self.weight.dtype and autocast_dtype(x.device.type) in (None, x.dtype)
                and (tracing or min(self.conv_out_size(x.shape[2:])) > 0))

    def _constant_output(self, x: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
        """No stripe kept: the output is the bias (or zeros) at every pixel, computed from x's shape only."""
        ho, wo = self.conv_out_size(x.shape[2:])
        out = torch.empty((x.shape[0], self.out_channels, ho, wo), dtype=x.dtype, device=x.device, memory_format=fmt)
        out.zero_()
        return out if self.bias is None else out + self.bias[:, None, None]

    # ---- extension protocol (compress.profile, compress.checkpoint) -----------------------------
    def macs(self, inp: torch.Tensor, out: torch.Tensor) -> int:
        """Multiply-adds of the kept stripes: B * Ho * Wo * S * C (Ho, Wo: the conv's output, before any pool)."""
        b, ho, wo = inp.shape[0], *self.conv_out_size(inp.shape[2:])
        return b * ho * wo * self.num_stripes * self.in_channels

    def conv_out_size(self, hw) -> tuple[int, int]:
        """The conv's output (Ho, Wo) for an input of spatial size hw = (H, W), before `pool`."""
        return tuple(conv_out_size(*a) for a in zip(hw, self.kernel_size, self.stride, self.padding, self.dilation))

    def config(self) -> dict:
        """JSON-serialisable constructor kwargs: `StripeConv2d(**m.config())` has the same shapes."""
        return {
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "kernel_size": list(self.kernel_size),
            "stride": list(self.stride),
            "padding": list(self.padding),
            "dilation": list(self.dilation),
            "num_stripes": self.num_stripes,
            "bias": self.bias is not None,
            "mode": self._mode,
            "relu": self.relu,
            "pool": self.pool,
            "pool_ceil": self.pool_ceil,
        }

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        params, buffers = dict(self._parameters), dict(self._buffers)
        kept = [(t, t.detach().clone()) for t in (*params.values(), *buffers.values()) if t is not None]
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

        def restore() -> None:  # the module stays as it was (weights, indices, plan), not half loaded
            self._parameters.update(params)  # the tensors themselves: load_state_dict(assign=True) replaced them
            self._buffers.update(buffers)
            with torch.no_grad():
                for t, value in kept:
                    t.copy_(value)

        if len(error_msgs) > errors:  # shapes that do not fit (another stripe count): load_state_dict raises with
            restore()  # PyTorch's size-mismatch message
            return
        for name in ("out_index", "offset"):  # assign=True keeps the given tensor: a compact file's int8/int16 indices
            t = self._buffers[name]
            if t is not None and t.dtype != torch.int64 and not t.is_floating_point() and t.dtype != torch.bool:
                self._buffers[name] = t.to(torch.int64)
        try:
            self._build_plan()
        except (ValueError, TypeError):  # invalid indices (TypeError: assigned ones of a float or bool dtype)
            restore()
            raise

    def _build_plan(self) -> None:
        """Validate the stripe indices (range, canonical order) and rebuild the kernel's index plan."""
        try:
            plan = kernels.stripe_plan(self.out_index, self.offset, self.out_channels, self.kernel_size)
        except ValueError as err:
            raise ValueError(
                f"StripeConv2d: invalid stripe indices ({err}); the state dict does not belong to this "
                "module or is corrupt: rebuild it with StripeConv2d.from_dense/from_skeleton"
            ) from None
        self.plan = plan
        self.rows = kernels.stripe_rows(self.out_index, self.offset, self.kernel_size)
        self._indexed = (self.out_index, self.offset, self.plan)
        self._tile_keep = kernels.stripe_tile_keep(plan, self.out_channels)
        self._trim = kernels.dense_trim(self.offset, self.kernel_size, self.padding, self.dilation)
        self._drop_caches()

    def check_indices(self) -> None:
        """ValueError unless `out_index` and `offset` are still the indices the layer's plan was built from (a
        state dict write that bypasses loading, such as an EMA that averages integer buffers, changes them; the
        forward keeps reading the plan, a saved file would hold the changed indices)."""
        if self.plan is None:
            raise ValueError(f"its {self.num_stripes} stripes were never set (a layer built with num_stripes=S holds "
                             "placeholders); fill it with load_state_dict, or build it with StripeConv2d.from_dense")
        try:
            same = torch.equal(
                kernels.stripe_plan(self.out_index, self.offset, self.out_channels, self.kernel_size).cpu(),
                self.plan.cpu())
        except ValueError:
            same = False
        if not same:
            raise ValueError(
                "its stripe indices (out_index, offset) were changed after it was built: an EMA or averaging tool "
                "that averages integer buffers too (timm's ModelEmaV2, AveragedModel(use_buffers=True)) corrupts "
                "them; average only floating-point tensors (timm's ModelEmaV3, AveragedModel(use_buffers=False)), "
                "or load a state dict with load_state_dict")

    def extra_repr(self) -> str:
        total = self.out_channels * self.kernel_size[0] * self.kernel_size[1]
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, stripes={self.num_stripes}/{total}"
        )
        return (s + f", bias={self.bias is not None}, mode={self._mode}" + (", relu=True" if self.relu else "")
                + (f", pool=True, pool_ceil={self.pool_ceil}" if self.pool else ""))


def stripe_counts(model: nn.Module) -> dict:
    """The stripe convs of a compact model: {"layers": how many, "stripes_kept", "stripes_total": over their
    (out_channels, kh, kw) positions} (ints)."""
    convs = [m for m in model.modules() if isinstance(m, StripeConv2d)]
    return {
        "layers": len(convs),
        "stripes_kept": sum(m.num_stripes for m in convs),
        "stripes_total": sum(m.out_channels * m.kernel_size[0] * m.kernel_size[1] for m in convs),
    }
