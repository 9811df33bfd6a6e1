"""Filter Skeletons for stripe-wise pruning (SWP, "Pruning Filter in Filter", NeurIPS 2020).

A Filter Skeleton (FS) is a Parameter of shape (out_channels, kh, kw), initialised to 1, that scales
every stripe (one filter's weights at one kernel offset, across all input channels) of a conv:
the forward pass uses `weight * FS[:, None]`. Training adds an L1 subgradient `alpha * sign(FS)` to
FS's gradient and zeroes every entry with |FS| <= threshold (value and gradient) at every step;
a filter with no stripe left is dead and its BatchNorm channel is zeroed.

Grouped skeletons (``stripe_group=G``, config ``prune.stripe_group``; our extension, not in the paper): one FS
entry per group of G consecutive filters and kernel offset, shape (ceil(out_channels / G), kh, kw), so the G
filters of a group keep or drop their stripes at an offset together, by the same L1 rule. Why: on a GPU a
tensor-core tile computes a block of output channels at once, and with per-filter masks nearly every (offset,
tile) block keeps some stripe, so no tile skips work (README "Not done yet"); with groups as wide as the tile,
the kernel's LISTED route computes only the offsets each tile keeps (``kernels.stripe_triton``). On an H200 (bf16,
channels_last, the issue's layer shapes) that made a layer 1.20-4.41x faster than cuDNN's dense conv at keep
0.11-0.2 and 0.97-3.15x at 0.2-0.34, where per-filter masks ran 0.69-0.89x from 64 channels
(benchmarks/results/stripe_blocks_gpu_h200_{narrow,wide}.json). Whole models gained little at the cuts measured
(README "Grouped stripes"). The masks are coarser than the paper's. The L1 term is not scaled with G while a shared
entry's loss gradient sums over its G filters, so the sparsity a given alpha reaches changes with G: tune
prune.alpha per G.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import math
import numbers
import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn

from compress._checks import check_module, check_one_input, check_real, listed, unwrapped
from compress._modes import LIBRARY_LOCK
from compress.surgery import (
    blank_conv,
    conv_bn_pairs,
    conv_like,
    hooked,
    mode_graphs,
    read_directly,
    read_outside_their_call,
    replace_module,
)
from kernels._utils import fx_tracing

__all__ = ["SkeletonConv2d", "attach_skeletons", "swp_update", "skeleton_stats"]


class SkeletonConv2d(nn.Conv2d):
    """Conv2d whose weight (N, C/groups, kh, kw) is scaled per stripe by `skeleton` (N, kh, kw), or with
    `stripe_group` G > 1 by `skeleton` (ceil(N / G), kh, kw), each entry shared by G consecutive filters.

    Every Conv2d argument (stride, padding incl. 'same', dilation, groups, bias, padding_mode)
    behaves exactly as in nn.Conv2d; only the weight used by the forward pass changes. Compaction turns
    groups=1 convs into StripeConv2d; a grouped one (`attach_skeletons` never makes one) stays a dense conv with
    its pruned stripes zeroed, with a warning.
    """

    def __init__(self, *args, stripe_group: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.stripe_group = check_stripe_group(stripe_group)
        kh, kw = self.kernel_size
        self.skeleton = nn.Parameter(
            torch.ones(-(-self.out_channels // self.stripe_group), kh, kw, device=self.weight.device,
                       dtype=self.weight.dtype)
        )

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, stripe_group: int = 1) -> SkeletonConv2d:
        """A SkeletonConv2d with `conv`'s arguments, weight, bias, device and dtype; skeleton = 1."""
        if not isinstance(conv, nn.Conv2d):  # (a ConvTranspose2d failed on the weight's shape)
            raise TypeError(f"SkeletonConv2d.from_conv: expected an nn.Conv2d, got {type(conv).__name__}")
        new = blank_conv(cls, conv, stripe_group=stripe_group)
        with torch.no_grad():
            new.skeleton.fill_(1.0)
            new.weight.copy_(conv.weight)
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
        return conv_like(new, conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) -> (B, N, Ho, Wo), the conv with weight * skeleton[:, None].

        Under autocast the product is formed once per forward in the compute dtype (e.g. bf16), the
        dtype the conv would cast the weight to anyway: one half-width multiply instead of an fp32
        multiply plus a cast, and the same for its backward. torch.compile fuses it into one kernel.
        """
        weight, skeleton = self.weight, self.skeleton
        # (autocast casts float32 only; under torch.fx tracing x is a Proxy, and F.conv2d casts at run time; meta
        # tensors, which profile counts, have no autocast state)
        if not fx_tracing() and weight.dtype == torch.float32 and not x.is_meta \
                and torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            weight, skeleton = weight.to(dtype), skeleton.to(dtype)
        return self._conv_forward(x, weight * self.per_filter(skeleton)[:, None], self.bias)

    def per_filter(self, t: torch.Tensor) -> torch.Tensor:
        """(groups, ...) -> (N, ...): each group's entry repeated for its filters (the identity when
        stripe_group == 1)."""
        if self.stripe_group == 1:
            return t
        return t.repeat_interleave(self.stripe_group, 0)[: self.out_channels]

    def stripe_scale(self) -> torch.Tensor:
        """(N, kh, kw): the factor of each filter's stripe (the skeleton, repeated over groups), detached."""
        return self.per_filter(self.skeleton.detach())

    def stripe_mask(self, threshold: float) -> torch.Tensor:
        """Bool (N, kh, kw): True where the stripe is kept, i.e. |skeleton| > threshold, compared in float64 (a
        float32 skeleton compared with the threshold rounded to float32 dropped values above it that round alike,
        so a model and its .double() kept different stripes). ValueError for a threshold that is not a number >= 0
        (NaN dropped every stripe, a negative one kept them all)."""
        value = threshold.item() if isinstance(threshold, torch.Tensor) and threshold.numel() == 1 else threshold
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
            raise ValueError(f"stripe_mask: threshold must be a number >= 0, got {threshold!r}")
        return self.stripe_scale().abs().double() > float(value)

    def check_finite(self, where: str) -> None:
        """ValueError naming `where` if the skeleton holds NaN or inf values (a diverged run): a NaN entry compares
        as not above any threshold, so compaction dropped its stripe and the compact model's outputs looked normal
        while the skeleton model's were NaN."""
        bad = int((~self.skeleton.detach().isfinite()).sum())
        if bad:
            raise ValueError(f"{where}: the skeleton holds {bad} NaN or inf values (the SWP run diverged); compact an "
                             "earlier checkpoint, or train again with a lower optim.lr or prune.alpha")

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", stripe_group={self.stripe_group}" if self.stripe_group > 1 else "")


def check_stripe_group(value) -> int:
    """The filters per skeleton entry: an int >= 1 (ValueError naming prune.stripe_group otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"SWP stripe_group must be an int >= 1 (filters sharing one skeleton entry per kernel "
                         f"offset; 1 = the paper's per-filter skeleton), got {value!r} (train.py: prune.stripe_group)")
    return int(value)


def check_nonnegative(**values: float) -> None:
    """ValueError unless each value is a finite real number >= 0 (NaN is not: |FS| > NaN would drop every stripe;
    an infinite alpha turns every skeleton NaN at the first step)."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            raise ValueError(f"SWP {key} must be a finite number >= 0, got {value!r}; set prune.{key} to a "
                             "non-negative number")


def _selected(name: str, include: Sequence[str] | None, exclude: Sequence[str] | None) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not (exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in exclude))


def attach_skeletons(
    model: nn.Module,
    min_kernel_size: int = 2,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    example_input: torch.Tensor | None = None,
    stripe_group: int = 1,
) -> list[str]:
    """Replace eligible Conv2d modules of `model` by SkeletonConv2d, in place; return their names. `stripe_group`:
    filters per skeleton entry (module docstring; 1 = the paper's skeleton).

    Eligible: plain nn.Conv2d, groups == 1, max(kh, kw) >= min_kernel_size, the name matches one of `include`
    (fnmatch patterns; None = all) and none of `exclude`. Convs that already have a skeleton are kept. Subclasses
    of nn.Conv2d whose forward transforms the weight or the input (timm's StdConv2d, ScaledStdConv2d, Conv2dSame)
    get none, with a warning naming them: a skeleton would change what they compute. A conv whose weight the
    forward also reads itself (``F.conv2d(x, conv.weight)``) gets none either, with a warning: it is found in the
    torch.fx graph, or, for a forward fx cannot trace, in one forward of `example_input` (a (B, C, H, W) batch
    the model takes; without it such reads go unseen).

    Build the optimizer after this call: the skeletons are new parameters, and each replaced conv's weight and
    bias are copied into its SkeletonConv2d, so an optimizer built before holds neither.
    """
    with LIBRARY_LOCK:  # (see compress._modes.LIBRARY_LOCK)
        check_module("attach_skeletons", model)
        if example_input is not None:
            if not isinstance(example_input, torch.Tensor):
                raise TypeError(f"attach_skeletons: example_input must be one tensor, a (B, C, H, W) batch the model "
                                f"takes; got {type(example_input).__name__}")
            check_one_input("attach_skeletons: example_input", model)
        stripe_group = check_stripe_group(stripe_group)
        if type(model) is nn.Conv2d:
            raise ValueError("attach_skeletons: the model is a bare nn.Conv2d, which cannot be replaced in place; wrap it "
                             "(nn.Sequential(conv)) or build SkeletonConv2d.from_conv(conv)")
        regrouped = [n for n, m in _skeleton_convs(model) if m.stripe_group != stripe_group]
        if regrouped:
            warnings.warn(f"attach_skeletons: {', '.join(regrouped[:5])}{', ...' if len(regrouped) > 5 else ''} already "
                          f"have skeletons of another stripe_group and keep them; stripe_group={stripe_group} applies to "
                          "the new skeletons only", stacklevel=2)
        names = eligible_convs(model, min_kernel_size, include, exclude, example_input)
        for name in names:
            replace_module(model, name, SkeletonConv2d.from_conv(model.get_submodule(name), stripe_group))
        from compress.stripe import Conv2dReLU

        subclassed = collections.Counter(
            f"{type(m).__module__}.{type(m).__qualname__}" for n, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and not isinstance(m, (SkeletonConv2d, Conv2dReLU)) and type(m) is not nn.Conv2d
            and _prunable(n, m, min_kernel_size, include, exclude)
        )  # fmt: skip
        if subclassed:
            warnings.warn(f"attach_skeletons: {dict(subclassed)} convs get no skeleton: only plain nn.Conv2d do (a "
                          "subclass's forward may standardise its weight or pad dynamically); their layers stay dense",
                          stacklevel=2)
        return names


def eligible_convs(
    model: nn.Module,
    min_kernel_size: int = 2,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    example_input: torch.Tensor | None = None,
) -> list[str]:
    """Names of the plain Conv2d modules of `model` that `attach_skeletons` (same arguments) gives a skeleton. A conv
    registered under several names, or whose weight other modules hold too (tied weights), gets none, with a
    warning: a skeleton conv in its place would untie it."""
    if isinstance(include, str) or isinstance(exclude, str):
        raise TypeError("attach_skeletons: include/exclude are lists of patterns, e.g. ['layer1.*']")
    if isinstance(min_kernel_size, bool) or not isinstance(min_kernel_size, numbers.Integral) or min_kernel_size < 1:
        raise ValueError(f"attach_skeletons: min_kernel_size must be an int >= 1 (the smallest max(kh, kw) that gets a "
                         f"skeleton; 2 leaves 1x1 convs dense), got {min_kernel_size!r} (train.py: "
                         "prune.min_kernel_size)")
    _warn_unmatched(model, include, exclude)
    names_of = collections.defaultdict(list)
    for name, m in model.named_modules(remove_duplicate=False):
        names_of[id(m)].append(name)
    from compress.stripe import stripe_padding_ok  # here: compress.stripe imports this module

    candidates = [(name, m) for name, m in model.named_modules()
                  if type(m) is nn.Conv2d and _prunable(name, m, min_kernel_size, include, exclude)]
    padded = [name for name, m in candidates if not stripe_padding_ok(m)]
    if padded:
        warnings.warn(f"attach_skeletons: {', '.join(padded[:5])}{', ...' if len(padded) > 5 else ''}: a padding that "
                      "stripe convs cannot express (padding_mode reflect/replicate/circular, or an asymmetric 'same') "
                      "gets no skeleton; those layers stay dense", stacklevel=3)
    with_hooks = hooked(model)
    hooked_convs = [name for name, _ in candidates if name in with_hooks]
    if hooked_convs:
        warnings.warn(f"attach_skeletons: {', '.join(hooked_convs[:5])}{', ...' if len(hooked_convs) > 5 else ''}: convs with "
                      "forward hooks of their own get no skeleton: a SkeletonConv2d in their place would drop the "
                      "hooks (torch.nn.utils.weight_norm and spectral_norm recompute the weight in one; their "
                      "torch.nn.utils.parametrizations versions keep working); those layers stay dense", stacklevel=3)
    eligible = [(name, m) for name, m in candidates if name not in padded and name not in hooked_convs]
    # an untraceable forward: compaction says so itself; without an input its direct weight reads go unseen
    unseen = (None if example_input is not None else "convs whose weight the forward reads itself (F.conv2d(x, "
              "conv.weight)) cannot be found without example_input=<a batch the model takes>, and a skeleton on one "
              "would not act there")
    graphs = mode_graphs(model, unseen) if eligible else []  # (training is where a skeleton must act)
    if graphs:
        direct = sorted(set().union(*(read_directly(graph) for graph in graphs)) & {name for name, _ in eligible})
    else:
        direct = sorted(_read_in_forward(model, example_input, [name for name, _ in eligible]))
    if direct:
        warnings.warn(f"attach_skeletons: {', '.join(direct[:5])}{', ...' if len(direct) > 5 else ''}: the forward "
                      "also reads the weight of these convs directly (as F.conv2d(x, conv.weight) does), outside their "
                      "call, where a skeleton would not act; they get none, and compaction leaves them as they are",
                      stacklevel=3)
    eligible = [(name, m) for name, m in eligible if name not in direct]
    shared = [names_of[id(m)] for _, m in eligible if len(names_of[id(m)]) > 1]
    if shared:
        warnings.warn(f"attach_skeletons: {', '.join(' = '.join(n) for n in shared)}: one conv under several names "
                      "(tied weights) gets no skeleton; a skeleton under one name would untie it", stacklevel=3)
    eligible = [(name, m) for name, m in eligible if len(names_of[id(m)]) == 1]
    holders = collections.defaultdict(list)  # id(parameter) -> the names it has in other modules too
    for name, p in model.named_parameters(remove_duplicate=False):
        holders[id(p)].append(name)
    def shared_params(m: nn.Module) -> list[tuple[str, ...]]:  # its weight or bias, where other modules hold it too
        return [tuple(holders[id(p)]) for p in (m.weight, m.bias) if p is not None and len(holders[id(p)]) > 1]

    tied = sorted({names for _, m in eligible for names in shared_params(m)})
    if tied:
        warnings.warn(f"attach_skeletons: {', '.join(' = '.join(n) for n in tied)}: a conv weight or bias that other "
                      "modules hold too (tied) gets no skeleton; a skeleton conv's own copy would untie it",
                      stacklevel=3)
    return [name for name, m in eligible if not shared_params(m)]


def _read_in_forward(model: nn.Module, x: torch.Tensor | None, names: list[str]) -> set[str]:
    """`read_outside_their_call` for a model fx cannot trace, or nothing (no input, no candidates, or a forward that
    fails on `x`: a warning says the reads went unchecked; the caller's own forward then gives the error)."""
    if x is None or not names:
        return set()
    try:
        return read_outside_their_call(model, x, names)
    except Exception as err:  # any failure of the user's forward: the check is skipped, not the run
        warnings.warn(f"attach_skeletons: one forward of a {tuple(x.shape)} input failed ({type(err).__name__}: "
                      f"{err}), so convs whose weight the forward reads itself were not looked for", stacklevel=4)
        return set()


def _warn_unmatched(model: nn.Module, include, exclude) -> None:
    """A warning naming each include / exclude pattern that matches no conv of `model` (misspelt, most likely: an
    include then selects fewer convs than meant, an exclude prunes a layer meant to stay dense)."""
    convs = [name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    for key, patterns in (("include", include), ("exclude", exclude)):
        unmatched = [p for p in patterns or () if not any(fnmatch.fnmatchcase(name, p) for name in convs)]
        if unmatched:
            warnings.warn(f"attach_skeletons: {key} pattern(s) {unmatched} match no conv of the model (conv names: "
                          f"{', '.join(convs[:4])}{', ...' if len(convs) > 4 else ''}); check the spelling (train.py: "
                          f"prune.{key})", stacklevel=4)


def _prunable(name: str, conv: nn.Conv2d, min_kernel_size: int, include, exclude) -> bool:
    """A conv's shape and name qualify it for a skeleton: groups == 1, a kernel of min_kernel_size or more, the
    name selected by `include` / `exclude`."""
    return conv.groups == 1 and max(conv.kernel_size) >= min_kernel_size and _selected(name, include, exclude)


def _skeleton_convs(model: nn.Module) -> list[tuple[str, SkeletonConv2d]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SkeletonConv2d)]


def skeleton_layers(model: nn.Module) -> list[str]:
    """The names of `model`'s SkeletonConv2d layers (the convs SWP prunes; what a compaction records)."""
    return [name for name, _ in _skeleton_convs(model)]


@torch.no_grad()
def swp_update(model: nn.Module, alpha: float, threshold: float, bn_pairs: dict[str, str] | None = None) -> None:
    """The SWP step between backward (and the DDP gradient all-reduce; under torch.amp.GradScaler,
    scaler.unscale_(optimizer): on scaled gradients the L1 term would shrink by the scale) and optimizer.step(), once
    per optimizer step.

    For each skeleton FS: FS.grad += alpha * sign(FS) (not for a frozen one, requires_grad=False: it gets no
    gradient); entries with |FS| <= threshold get value and gradient zeroed. Filters without a kept stripe have weight, bias and their gradients of the
    paired BatchNorm channel zeroed. Frozen skeletons and BatchNorms are masked too, so that the training model
    computes what compaction keeps (`compact` drops those stripes and channels either way): a layer that must stay
    exactly as it is gets no skeleton (`attach_skeletons(..., exclude=...)`, train.py's prune.exclude). `model` may be wrapped (DataParallel, DDP, torch.compile). `bn_pairs` ({conv name: BN name}): `compress.surgery.conv_bn_pairs(model)`,
    which traces the model, so a training loop finds it once and passes it to every step; None finds it here.

    All layers at once with torch._foreach_* ops (a few multi-tensor kernels instead of ~8 per layer,
    which made a CIFAR ResNet-56 step launch-bound on a GPU) and no host sync: keep = clamp_min(sign(
    |FS| - t), 0), with t the largest value of FS's dtype <= threshold, is 1 exactly where |FS| > threshold (as
    `stripe_mask` compares, in float64), and value and gradient are multiplied by it.
    """
    check_nonnegative(alpha=alpha, threshold=threshold)
    model = unwrapped(model)  # (DataParallel, DDP, torch.compile: the BN pairs are traced in the model inside)
    convs = _skeleton_convs(model)
    if not convs:  # (training with no skeleton would prune nothing, and compaction find nothing to remove)
        raise ValueError("swp_update: the model has no skeleton convs; call compress.attach_skeletons(model) before "
                         "training (or leave swp_update out of a run that does not prune)")
    parametrized = [name for name, conv in convs if torch.nn.utils.parametrize.is_parametrized(conv, "skeleton")]
    if parametrized:  # (each read of conv.skeleton is then a new tensor: the masks would zero a temporary)
        raise ValueError(f"swp_update: the skeleton of {listed(parametrized)} has a parametrization "
                         "(torch.nn.utils.parametrize); SWP updates the stored skeleton itself: remove it with "
                         "parametrize.remove_parametrizations(conv, 'skeleton')")
    fss = list({id(conv.skeleton): conv.skeleton for _, conv in convs}.values())  # (one shared by convs: once)
    trained = [fs for fs in fss if fs.requires_grad]  # a frozen skeleton gets no gradient: an optimizer would step it
    if alpha and trained and all(fs.grad is None for fs in trained):  # (alpha 0: a call that only applies masks)
        warnings.warn("swp_update: no skeleton has a gradient; call it after loss.backward() (under GradScaler, after "
                      "scaler.unscale_(optimizer)) and before optimizer.step(), once per optimizer step",
                      stacklevel=3)  # (the caller's line: torch.no_grad's wrapper is a frame between)
    for fs in trained:
        if fs.grad is None:
            fs.grad = torch.zeros_like(fs)
    grads = [fs.grad for fs in trained]
    if alpha and grads:
        torch._foreach_add_(grads, torch._foreach_sign(trained), alpha=alpha)
    keep = torch._foreach_abs(fss)
    torch._foreach_sub_(keep, [_at_most(threshold, fs.dtype) for fs in fss])
    keep = torch._foreach_sign(keep)
    torch._foreach_clamp_min_(keep, 0.0)
    torch._foreach_mul_(fss, keep)
    if grads:
        torch._foreach_mul_(grads, [k for fs, k in zip(fss, keep) if fs.requires_grad])
    pairs = conv_bn_pairs(model) if bn_pairs is None else bn_pairs
    keep_of = {id(fs): k for fs, k in zip(fss, keep)}
    bn_alive: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(BN tensor) -> (tensor, channels alive)
    for name, conv in convs:
        if name not in pairs:
            continue
        bn = model.get_submodule(pairs[name])
        # 1 where the filter keeps a stripe, else 0
        filter_alive = conv.per_filter(keep_of[id(conv.skeleton)].flatten(1).amax(dim=1))
        for p in (bn.weight, bn.bias):
            for t in (p, None if p is None else p.grad):
                if t is not None:
                    shared = bn_alive.get(id(t))  # a BN tensor two convs' BNs share: a channel alive in either stays
                    bn_alive[id(t)] = (t, filter_alive if shared is None else torch.maximum(shared[1], filter_alive))
    if bn_alive:
        torch._foreach_mul_([t for t, _ in bn_alive.values()], [a.to(t.dtype) for t, a in bn_alive.values()])


@functools.lru_cache(maxsize=64)  # (one per threshold and dtype: swp_update runs every step)
def _at_most(threshold: float, dtype: torch.dtype) -> float:
    """The largest `dtype` value <= threshold: a `dtype` value v is > threshold exactly where v > it, so swp_update
    keeps what stripe_mask (float64) keeps. The threshold itself rounded to the dtype may lie above it (0.01 in
    bfloat16 is 0.010009765625): an entry equal to that was zeroed, and compact and skeleton_stats kept it."""
    exact = torch.tensor(threshold, dtype=torch.float64)
    value = exact.to(dtype)
    if value.double() > exact:
        value = torch.nextafter(value, torch.tensor(float("-inf"), dtype=dtype))
    return float(value)


@torch.no_grad()
def skeleton_stats(model: nn.Module, threshold: float) -> dict:
    """Stripe statistics at `threshold`.

    Returns {"layers": {name: {stripes_total, stripes_kept, filters_total, filters_dead}},
    "stripes_total", "stripes_kept", "filters_total", "filters_dead"} (counts are ints). ValueError naming the
    layer for a skeleton with NaN or inf values (its NaN stripes counted as pruned, as compact refuses it).
    """
    check_nonnegative(threshold=threshold)
    check_real("skeleton_stats", model)
    layers = {}
    for name, conv in _skeleton_convs(model):
        conv.check_finite(f"skeleton_stats: layer {name}")
        mask = conv.stripe_mask(threshold)
        layers[name] = {
            "stripes_total": mask.numel(),
            "stripes_kept": int(mask.sum()),
            "filters_total": mask.shape[0],
            "filters_dead": int((~mask.flatten(1).any(dim=1)).sum()),
        }
    keys = ("stripes_total", "stripes_kept", "filters_total", "filters_dead")
    return {"layers": layers, **{k: sum(v[k] for v in layers.values()) for k in keys}}
