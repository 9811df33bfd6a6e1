"""Compaction: a trained skeleton model -> a smaller model that computes the same function.

`compact(model)` returns a new model (the caller's is never changed) where
- every SkeletonConv2d becomes a StripeConv2d holding only its kept stripes, or a plain nn.Conv2d
  when all its stripes are kept;
- dead filters (no stripe left) are removed with their BN channel and the next conv's (or the final
  Linear's) matching input channels wherever torch.fx finds a conv -> channel-wise ops -> conv chain
  (plain VGG chains, the inner convs of residual blocks; never a conv feeding an add or a concat).
  A dead filter's constant output (its BN bias after the activation) is folded into the next layer's
  bias when that layer does not pad its input, else the filter is kept: the result is always exact;
- a conv with no stripe left at all (e.g. the last conv of a fully pruned residual branch) becomes a
  StripeConv2d with 0 stripes, which outputs its bias without reading its input, and the branch's
  earlier convs shrink to one zero channel: only the shortcut path does work; a PiX block whose output
  reaches only such convs becomes a `ZeroChannels` of its shape (its pool, predictor and fusion would be
  work for nothing), and a conv whose output reaches only those a StripeConv2d with no stripe, up the branch
  (`_drop_unread_work`; channel removal does not reach through PiX blocks);
- optionally BN is folded into the preceding conv, and a MAC budget picks the threshold;
- a StripeConv2d already in `model` (a compact model fine-tuned and compacted again) is treated like a
  skeleton conv whose kept stripes are its stripes, so its BN folds and its dead filters go too;
- `channel_multiple=8` keeps each shrunk conv's output channels a multiple of 8 where it can (extra kept
  channels are ones that change nothing: all-zero filters whose outputs are zero or are never read). GPU
  tensor-core convolutions (cuDNN, bf16/fp16 channels_last) take a slow path for other channel counts:
  on an H200 random dead filters made a 73%-pruned VGG16 slower than the dense one.

The chosen threshold and MAC counts are recorded in `compact_model.compress_compaction` (a dict:
threshold, fold_bn, target_macs, macs, dense_macs, relu_fused and pool_fused (how many ReLUs and max-pools went
into convs), channel_multiple, skeleton_layers (the convs that had skeletons); MACs are None when no budget was given; threshold is None
for a model without skeletons; fold_bn says whether BatchNorms were folded: false where the model has none or
could not be traced). A compact model compacted again keeps the record of what chose its stripes
(threshold, target_macs, dense_macs) and takes the new layout's (`_carried_record`).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.nn.modules.utils import _pair

import kernels
from compress._checks import check_one_input, check_real, chw, refuse_wrapper
from compress._modes import LIBRARY_LOCK, evaluating
from compress.pix import PiXBlock
from compress.pooling import MaxPool2d, fast_max_pools
from compress.skeleton import SkeletonConv2d, skeleton_layers, skeleton_stats
from compress.stripe import Conv2dReLU, StripeConv2d, masked_conv, stripe_padding_ok
from compress.surgery import (
    WEIGHT_HOOKS,
    Chain,
    bn_remainder,
    called_once,
    chain_constants,
    common_chains,
    common_pairs,
    consumer_columns,
    consumers_unpadded,
    copy_model,
    fold_constant_inputs,
    get_module,
    hooked,
    is_batch_norm,
    is_elementwise,
    left_alone,
    mode_graphs,
    refresh_weight,
    remove_channels,
    replace_module,
)
from compress.surgery import fold_bn as fold_bn_into_conv
from kernels._utils import memory_format

__all__ = ["compact", "choose_modes", "ZeroChannels"]


def zero_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """Zeros (B, channels, H, W) for x (B, C, H, W) (or unbatched), in x's dtype, device and layout."""
    fmt = memory_format(x) if x.dim() == 4 else torch.contiguous_format
    shape = (*x.shape[:-3], channels, *x.shape[-2:])
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt).zero_()


torch.fx.wrap("zero_channels")  # a leaf in torch.fx graphs (it reads x's layout)


class ZeroChannels(nn.Module):
    """(B, C, H, W) -> zeros (B, channels, H, W) in x's dtype, device and layout (NCHW or channels_last); an
    unbatched (C, H, W) -> (channels, H, W), as the PiX block it replaces.

    `compress.compact` puts it in place of a PiX block whose output reaches only convs with no stripe left, which
    read nothing of their input but its shape."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = int(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_channels(x, self.channels)

    def config(self) -> dict:
        return {"channels": self.channels}

    def extra_repr(self) -> str:
        return f"channels={self.channels}"


def compact(
    model: nn.Module,
    threshold: float | None = None,
    fold_bn: bool = False,
    target_macs: float | None = None,
    input_size: Sequence[int] | None = None,
    channel_multiple: int = 1,
    fuse_relu: bool = False,
) -> nn.Module:
    """A compact copy of `model` (see the module docstring); `model` itself is left unchanged.

    Args:
        model: any model, usually with SkeletonConv2d layers (compress.attach_skeletons).
        threshold: stripes with |skeleton| <= threshold are dropped (default 0: only the exactly-zero ones,
            so the compact model equals the skeleton model exactly). For a model trained with `swp_update`,
            pass its training threshold: the optimizer's momentum moves the stripes swp_update zeroes off zero
            again, by the learning rate times their momentum (|skeleton| about 1e-7 in the default digits run),
            so 0 would keep nearly all of them. Without SkeletonConv2d layers (a compact model
            compacted again) it has no effect (a warning says so when > 0).
        fold_bn: fold every BatchNorm2d that directly follows a conv into that conv (inference only;
            the BN becomes nn.Identity).
        target_macs: a MAC budget for one input, as a fraction in (0, 1] of the dense model's MACs or
            an absolute count (> 1). The threshold is raised (bisection over the sorted |skeleton|
            values) to the smallest value whose compact model meets the budget.
        input_size: (C, H, W) used to count MACs for `target_macs`; default from
            `model.compress_arch` (in_chans, input_size, input_size).
        channel_multiple: round the kept output channels of each shrunk conv up to a multiple of this
            (8 for GPU tensor cores), using channels that change nothing; 1 = remove all removable.
        fuse_relu: with fold_bn, a conv (plain or stripe) whose output goes only, through folded BNs, to a ReLU
            module that runs once takes that ReLU into its epilogue (`Conv2dReLU`, `StripeConv2d(relu=True)`;
            on CUDA one cuDNN call or the stripe kernel) and the ReLU becomes nn.Identity; a StripeConv2d also
            takes a 2x2 stride-2 max-pool that only reads that ReLU (`StripeConv2d(pool=True)`), and the other
            nn.MaxPool2d modules become `compress.pooling.MaxPool2d` (same values; a C++ kernel for CPU NCHW
            inference, 1.4-10x PyTorch's NCHW pool). Inference only.

    Returns:
        The compact model (same training mode, device and dtype, `compress_arch` kept) with
        `compress_compaction = {threshold, fold_bn, target_macs, macs, dense_macs, relu_fused, pool_fused,
        channel_multiple, skeleton_layers}` (module docstring).
    """
    with LIBRARY_LOCK:  # (see compress._modes.LIBRARY_LOCK)
        refuse_wrapper("compact", model, "compact")
        check_real("compact", model)
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                      or not threshold >= 0):
            raise ValueError(f"compact: threshold must be a number >= 0 (or None for 0), got {threshold!r}")
        base = 0.0 if threshold is None else float(threshold)
        if not isinstance(channel_multiple, int) or isinstance(channel_multiple, bool) or channel_multiple < 1:
            raise ValueError(f"compact: channel_multiple must be an int >= 1 (8 for GPU tensor cores), got {channel_multiple!r}")
        if fuse_relu and not fold_bn:
            raise ValueError("compact: fuse_relu=True needs fold_bn=True (a BatchNorm sits between a conv and its ReLU)")
        pruned_layers = skeleton_layers(model)
        for name in pruned_layers:
            model.get_submodule(name).check_finite(f"compact: layer {name}")
        has_skeletons = bool(pruned_layers)
        if base > 0 and not has_skeletons:
            warnings.warn(f"compact: threshold={threshold} has no effect: the model has no skeletons (a compact model "
                          "keeps the stripes it holds)", stacklevel=2)
        if target_macs is not None and not has_skeletons:
            raise ValueError(
                f"compact: target_macs={target_macs} needs a model with skeletons (a SWP training model) to choose "
                "stripes from; this one has none (a compact model, or one never given skeletons). Compact the training "
                "checkpoint with target_macs instead (python export.py ckpt=<run>/checkpoints/last.pt target_macs=...)"
            )
        if target_macs is None:
            out, macs, dense = _compact_at(model, base, fold_bn, channel_multiple), None, None
        else:
            out, base, macs, dense = _compact_to_budget(model, base, fold_bn, target_macs, input_size, channel_multiple)
        _warn_train_mode(model, fold_bn, base)
        fused = _fuse_relu(out) if fuse_relu else []
        if fuse_relu:
            fast_max_pools(out)
        before = getattr(model, "compress_compaction", None)
        if macs is None and isinstance(before, dict) and before.get("macs") is not None:
            macs = _macs(out, _input_size(model, input_size))  # a budgeted compact model compacted again: its MACs now
        record = {
            "threshold": base if has_skeletons else None,
            "fold_bn": bool(fold_bn) and _batch_norms(out) < _batch_norms(model),  # what happened (an untraceable model
            # keeps every BN)
            "relu_fused": len(fused),
            "pool_fused": sum(isinstance(m, StripeConv2d) and m.pool for m in out.modules()),
            "channel_multiple": channel_multiple,
            "target_macs": target_macs,
            "macs": macs,
            "dense_macs": dense,
            # the convs whose stripes were chosen (export's stripe table; a compact model's: its first compaction's)
            "skeleton_layers": pruned_layers,
        }
        out.compress_compaction = _carried_record(before, record) if isinstance(before, dict) else record
        return out


def _batch_norms(model: nn.Module) -> int:
    return sum(is_batch_norm(m) for m in model.modules())


def _warn_train_mode(model: nn.Module, fold_bn: bool, threshold: float) -> None:
    """Warn where the compact model's train-mode function differs from `model`'s: a BatchNorm of `model` in train mode
    and either BN folding or a dead filter at `threshold` (the one compaction used), whose constant output is folded
    through its BN's running statistics (the eval-mode function) where a train-mode BN gives its bias."""
    if not any(is_batch_norm(m) and m.training for m in model.modules()):
        return
    if fold_bn or skeleton_stats(model, threshold)["filters_dead"]:
        warnings.warn("compact: the model is in train mode; " + (
            "fold_bn=True folds each BatchNorm's running statistics, so the result computes the eval-mode function "
            "even in train mode" if fold_bn else
            "a dead filter's constant output is folded into the next layer through its BatchNorm's running "
            "statistics (the eval-mode function), where a train-mode BatchNorm gives its bias") +
            "; call model.eval() first", stacklevel=3)


def _carried_record(before: dict, after: dict) -> dict:
    """The compaction record of a compact model compacted again (export of a compact file or of an init= run):
    what chose its stripes (threshold, target_macs) and its dense MACs stay as first recorded; the layout
    (fold_bn, fusions, channel multiple) and its MACs (counted again by `compact` when the first pass had a
    budget) are the new model's, fusions counted over both passes."""
    record = dict(after)
    for key in ("threshold", "target_macs", "dense_macs", "skeleton_layers"):
        if key in before:
            record[key] = before[key]
    record["fold_bn"] = bool(before.get("fold_bn")) or after["fold_bn"]
    record["relu_fused"] = int(before.get("relu_fused", 0)) + after["relu_fused"]
    return record


def _compact_at(model: nn.Module, threshold: float, fold: bool, multiple: int = 1) -> nn.Module:
    out = copy_model(model)
    for copied, original in zip(out.modules(), model.modules()):  # (torchvision's feature extractors copy into
        copied.training = original.training  # train mode: their BNs would then use batch statistics)
    pruned = []
    for name, m in list(out.named_modules()):
        if isinstance(m, SkeletonConv2d):
            refresh_weight(m)
            _replace_keeping_hooks(out, name, m, masked_conv(m, threshold))
            pruned.append(name)
        elif isinstance(m, StripeConv2d) and not (m.relu or m.pool):
            # a compact model compacted again (one exported with fold_bn=false and fine-tuned with init=): its
            # stripe convs go back to zero-filled convs, so that dead filters, BN folding and ReLU fusion see
            # them, and return as stripe convs below. Ones with an epilogue are final already (no BN after them).
            refresh_weight(m)
            _replace_keeping_hooks(out, name, m, m.to_dense())
            pruned.append(name)
    kept_dense = sorted(hooked(out) & set(pruned))
    if kept_dense:
        warnings.warn(f"compact: {', '.join(kept_dense[:5])}{', ...' if len(kept_dense) > 5 else ''}: layers with "
                      "hooks of their own keep them and stay nn.Conv2d with the pruned stripes zeroed (surgery leaves "
                      "hooked modules alone: a hook may read their tensors); remove the hooks to compact them",
                      stacklevel=3)
    graphs = mode_graphs(out)  # (eval, and training where its forward differs: surgery holds in both)
    direct = set().union(*(left_alone(graph, out) for graph in graphs))
    if graphs:
        chains = common_chains(out, graphs)
        while any([_shrink(out, chain, multiple) for chain in chains]):
            pass
        if fold:
            for conv_name, bn_name in common_pairs(out, graphs).items():
                bn = get_module(out, bn_name)
                fold_bn_into_conv(get_module(out, conv_name), bn)
                replace_module(out, bn_name, bn_remainder(bn))
    _to_stripe_convs(out, pruned, direct)
    if graphs:
        _drop_unread_work(out, direct)
    return out


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook")


def _replace_keeping_hooks(model: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """`replace_module`, with old's forward and backward hooks moved to new (the user's, e.g. feature capture: the
    masked conv computes what old did, so they see the same values; dropping them changed the model's output),
    except `WEIGHT_HOOKS`, whose result new's weight holds (the conv built in old's place lacks their tensors)."""
    dropped = {key for key, hook in old._forward_pre_hooks.items() if isinstance(hook, WEIGHT_HOOKS)}
    for attr in _MODULE_HOOKS:
        hooks = getattr(old, attr)
        if isinstance(hooks, dict):
            hooks = type(hooks)((key, hook) for key, hook in hooks.items() if key not in dropped)
        setattr(new, attr, hooks)
    replace_module(model, name, new)


def _drop_unread_work(model: nn.Module, direct: set[str]) -> None:
    """In place: each PiX block whose every call's output reaches only layers that read nothing of it but its shape
    (`_reads_only_shape`) becomes a `ZeroChannels` of its shape, and each such groups-1 conv a StripeConv2d with no
    stripe (its bias, from the input's shape alone); repeated, as each makes the layer before it unread too (in a
    PiX model a fully pruned branch's earlier convs and PiX blocks, which channel removal cannot reach through the
    blocks). Convs surgery leaves alone (`direct`) keep their work."""
    while True:
        graphs = mode_graphs(model, "layers whose output only convs with no stripe left read keep running",
                             quiet=True)  # (compaction's first trace warned of a forward it could not trace)
        if not graphs:
            return
        calls: dict[str, list[bool]] = {}  # (every call in either mode's graph)
        for node in (node for graph in graphs for node in graph.nodes):
            if node.op != "call_module" or node.target in direct:
                continue
            m = get_module(model, node.target)
            if isinstance(m, PiXBlock) or (type(m) is nn.Conv2d and m.groups == 1 and stripe_padding_ok(m)) \
                    or (isinstance(m, StripeConv2d) and m.num_stripes > 0 and not (m.relu or m.pool)):
                calls.setdefault(node.target, []).append(_reads_only_shape(model, node, direct))
        unread = [name for name, uses in calls.items() if all(uses)]
        convs = []
        for name in unread:
            m = get_module(model, name)
            if isinstance(m, PiXBlock):
                replace_module(model, name, ZeroChannels(m.out_channels))
                continue
            conv = m.to_dense() if isinstance(m, StripeConv2d) else m
            with torch.no_grad():
                conv.weight.zero_()
            replace_module(model, name, conv)
            convs.append(name)
        _to_stripe_convs(model, convs, direct)
        if not unread:
            return


def _reads_only_shape(model: nn.Module, node, direct: set[str]) -> bool:
    """Whether every use of `node`'s value is a StripeConv2d with no stripe (its first argument; it outputs its
    bias from the input's shape alone), a ZeroChannels, or an elementwise step whose own uses are such; never
    through a module surgery leaves alone (`direct`: a hook of its own may read the values)."""
    for user in node.users:
        if user.op == "call_module" and user.target in direct:
            return False
        if user.op == "call_module" and user.args[:1] == (node,) and not user.kwargs and len(user.args) == 1:
            m = get_module(model, user.target)
            if (isinstance(m, StripeConv2d) and m.num_stripes == 0) or isinstance(m, ZeroChannels):
                continue
        if not (is_elementwise(model, user) and user.args[0] is node and _reads_only_shape(model, user, direct)):
            return False
    return bool(node.users)


@torch.no_grad()
def _shrink(model: nn.Module, chain: Chain, multiple: int = 1) -> bool:
    """Remove the producer channels of `chain` that the consumers do not read (zero weights) or that
    are dead with a constant that folds exactly, keeping a multiple of `multiple` channels where
    harmless ones allow; True if anything changed (idempotent once nothing is left to remove)."""
    producer = get_module(model, chain.producer)
    dead = producer.weight.flatten(1).abs().amax(1) == 0
    cols = [consumer_columns(model, chain, n).abs().amax(dim=(0, 2)) for n in chain.consumers]
    unused = torch.stack(cols).amax(0) == 0
    values = chain_constants(model, chain)
    removable = unused | (dead & ((values == 0) | consumers_unpadded(model, chain)))
    if multiple > 1:  # keep back harmless channels: never read, or a zero filter whose output is 0
        harmless = (removable & (unused | (dead & (values == 0)))).nonzero().flatten()
        kept = int((~removable).sum())
        extra = min(len(harmless), -kept % multiple if kept else 0)
        removable[harmless[:extra]] = False
    neutralise = removable & dead & ~unused
    changed = bool(neutralise.any())
    if changed:
        fold_constant_inputs(model, chain, values, neutralise)
    keep = ~removable
    if not bool(keep.any()):  # keep one channel that nothing reads, with a zero filter
        keep[0] = True
        if bool(producer.weight[0].any()):
            producer.weight[0] = 0
            changed = True
    if not bool(keep.all()):
        remove_channels(model, chain, keep)
        changed = True
    return changed


def _to_stripe_convs(model: nn.Module, pruned: list[str], direct: set[str]) -> None:
    """Pruned convs -> StripeConv2d (or stay nn.Conv2d when every stripe is kept); any other groups-1
    conv whose weight is all zero -> StripeConv2d with no stripe. Convs surgery leaves alone (`direct`,
    `left_alone`: the forward also reads their weight, or a hook of theirs may) stay nn.Conv2d: a StripeConv2d holds
    its weight in another shape."""
    for name, m in list(model.named_modules()):
        if type(m) is nn.Conv2d and m.groups != 1 and name in pruned \
                and not bool((m.weight.detach().abs().amax(1) > 0).all()):
            warnings.warn(f"compact: {name} has groups={m.groups}; its pruned stripes are zeroed in a dense nn.Conv2d, "
                          "which saves no work (StripeConv2d takes groups=1 convs only)", stacklevel=4)
        if type(m) is not nn.Conv2d or m.groups != 1 or (name not in pruned and not stripe_padding_ok(m)):
            continue
        if name in direct:
            continue
        mask = m.weight.detach().abs().amax(1) > 0  # (N, kh, kw)
        if (name in pruned and not bool(mask.all())) or not bool(mask.any()):
            try:
                stripe = StripeConv2d.from_dense(m, mask)
            except ValueError as err:  # a layout stripe convs cannot take (padding_mode, asymmetric 'same'): which
                raise ValueError(f"compact: {name}: {err}") from None
            stripe.mode = _cost_model_mode(stripe)
            replace_module(model, name, stripe)


def _fuse_relu(model: nn.Module) -> list[str]:
    """Fold each ReLU module into the conv before it (see `compact`'s fuse_relu), in place; returns the convs.

    A conv qualifies when torch.fx shows it called once, its output going through nothing but once-called
    nn.Identity modules (folded BNs) to a once-called nn.ReLU (a module shared by several call sites, as
    torchvision's Bottleneck ReLU, is left alone). A StripeConv2d also takes the 2x2 max-pool that is that ReLU's
    only consumer (`_is_pool2x2`; VGG's pools), which its kernel computes in the epilogue."""
    graphs = mode_graphs(model, quiet=True)  # (compaction's first trace warned of a forward it could not trace)
    plans = [_relu_fusions(model, graph) for graph in graphs]  # the same in both modes' graphs, or not fused
    fused = []
    for name, (relu, pool) in (plans[0] if plans else {}).items():
        if any(plan.get(name) != (relu, pool) for plan in plans[1:]):
            continue
        conv = get_module(model, name)
        if isinstance(conv, StripeConv2d):
            conv.relu = True
            if pool is not None:
                conv.pool, conv.pool_ceil = True, get_module(model, pool).ceil_mode
                replace_module(model, pool, nn.Identity())
        else:
            replace_module(model, name, Conv2dReLU.from_conv(conv))
        replace_module(model, relu, nn.Identity())
        fused.append(name)
    return fused


def _relu_fusions(model: nn.Module, graph) -> dict[str, tuple[str, str | None]]:
    """{conv: (its ReLU, the 2x2 max-pool a StripeConv2d takes too, or None)} of the fusions `_fuse_relu` makes by
    fx graph `graph`."""
    once = called_once(graph, model)
    plan = {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in once:
            continue
        conv = get_module(model, node.target)
        if type(conv) is not nn.Conv2d and not isinstance(conv, StripeConv2d):
            continue
        relu = _sole_consumer(model, node, once)
        if relu is None or type(get_module(model, relu.target)) is not nn.ReLU:
            continue
        pool = _sole_consumer(model, relu, once) if isinstance(conv, StripeConv2d) else None
        plan[node.target] = (relu.target, pool.target if pool is not None and
                             _is_pool2x2(get_module(model, pool.target)) else None)
    return plan


def _sole_consumer(model: nn.Module, node, once: set[str]):
    """The fx node of the once-called module (`called_once`), not an nn.Identity, that is the only consumer of fx
    node `node` through once-called nn.Identity modules (folded BNs, fused ReLUs); None if there is none."""
    while len(node.users) == 1:
        (node,) = node.users
        if node.op != "call_module" or node.target not in once:
            return None
        if type(get_module(model, node.target)) is not nn.Identity:
            return node
    return None


def _is_pool2x2(mod: nn.Module) -> bool:
    """A 2x2 stride-2 max-pool without padding, dilation or indices (either ceil mode): `StripeConv2d.pool`."""
    return (type(mod) in (nn.MaxPool2d, MaxPool2d) and _pair(mod.kernel_size) == (2, 2) and _pair(mod.stride) == (2, 2)
            and _pair(mod.padding) == (0, 0) and _pair(mod.dilation) == (1, 1) and not mod.return_indices)


def _cost_model_mode(m: StripeConv2d) -> str:
    ratio = kernels.stripe_cost(
        m.in_channels, m.out_channels, m.num_stripes, m.kernel_size, m.weight.device.type, m.tile_keep
    )
    return "stripe" if ratio < 1 else "dense"


@torch.no_grad()
def choose_modes(model: nn.Module, x: torch.Tensor, repeats: int = 5, timing: str = "auto",
                 report: dict | None = None) -> dict[str, str]:
    """Time each StripeConv2d of `model` on its real input for one forward of `x` (stripe op against
    F.conv2d with the zero-filled weight and, on tiny feature maps, the unrolled GEMM: kernels.stripe_route) and
    set the fastest mode, like cudnn.benchmark. Call once, with a representative batch; the forward runs in eval mode
    (the model's mode is restored after). Returns {name: mode}.

    timing (see kernels.stripe_route): "graph" compares GPU time (the default on CUDA: for models run in CUDA
    graphs or compiled), "eager" the wall time of an eager call, launch overhead included (the default on CPU;
    choose it on CUDA for a model that will run eagerly). `report`, if given, receives each layer's
    measurement: {name: kernels.stripe_route's dict}."""
    refuse_wrapper("choose_modes", model, "choose the modes of")  # (a compiled graph would skip the input hooks)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"choose_modes: repeats must be an int >= 1, got {repeats!r}")
    check_one_input("choose_modes", model)
    check_real("choose_modes", model)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, StripeConv2d) and m.num_stripes}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, name=n: inputs.setdefault(name, args[0].clone()))
        for n, m in layers.items()
    ]
    try:
        with evaluating(model), torch.no_grad():
            model(x)  # the inputs inference sees; a train-mode model's BN statistics stay as they were
    finally:
        for h in hooks:
            h.remove()
    for name, inp in inputs.items():
        m = layers[name]
        route = kernels.stripe_route(
            inp, m.weight, m.out_index, m.offset, m.bias, m.out_channels, m.kernel_size,
            m.stride, m.padding, m.dilation, plan=m.plan, repeats=repeats, timing=timing, relu=m.relu, pool=m.pool,
            pool_ceil=m.pool_ceil, tile_keep=m.tile_keep,
        )  # fmt: skip
        m.mode = route["mode"]
        if report is not None:
            report[name] = route
    return {name: layers[name].mode for name in inputs}


# ---- MAC budget ----------------------------------------------------------------------------------
def _input_size(model: nn.Module, input_size: Sequence[int] | None) -> tuple[int, int, int]:
    if input_size is not None:
        return chw("compact", input_size)
    kwargs = getattr(model, "compress_arch", {}).get("kwargs", {})
    if "input_size" not in kwargs:
        raise ValueError(
            "compact: target_macs needs the input size to count MACs; pass input_size=(C, H, W) "
            "(the model has no compress_arch to read it from)"
        )
    size = kwargs["input_size"]
    return (int(kwargs.get("in_chans", 3)), int(size), int(size))


def _macs(model: nn.Module, input_size: tuple[int, int, int]) -> int:
    from compress.profile import profile

    return profile(model, input_size, latency=False).macs


# a budget met with less than this share of it gets a warning (tied skeleton values, _compact_to_budget)
UNDERSHOOT = 0.8


def check_target_macs(target, name: str = "compact: target_macs") -> None:
    """ValueError naming `name` unless `target` is a MAC budget: a fraction in (0, 1] of the dense MACs or a count."""
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not 0 < target < math.inf:
        raise ValueError(f"{name} must be a fraction in (0, 1] of the dense model's MACs or a MAC count > 1, got "
                         f"{target!r}")
    if target > 1 and not float(target).is_integer():
        raise ValueError(f"{name}={target!r} is neither a fraction in (0, 1] of the dense model's MACs nor a whole "
                         "count of MACs; for a share give a value up to 1 (e.g. 0.5)")


def _compact_to_budget(model, base, fold, target, input_size, multiple=1):
    """Smallest threshold >= base among base and the |skeleton| values above it whose compact model meets
    the budget (bisection: MACs fall as the threshold rises). Returns (model, threshold, macs, dense)."""
    check_target_macs(target)
    check_one_input("compact: target_macs", model)
    size = _input_size(model, input_size)
    try:
        dense = _macs(model, size)
    except Exception as err:  # (a wrong channel count fails deep in the first conv)
        detail = " ".join(str(err).split())[:300]
        raise ValueError(f"compact: target_macs counts MACs on one input of input_size={size}, and the model's forward "
                         f"failed on it ({type(err).__name__}: {detail}); give input_size=(C, H, W) as the model takes "
                         "it") from err
    budget = target * dense if target <= 1 else target
    fs = [m.skeleton.detach().abs().flatten() for m in model.modules() if isinstance(m, SkeletonConv2d)]
    above = torch.unique(torch.cat(fs)) if fs else torch.zeros(0)
    values = [base] + above[above > base].tolist()
    best: tuple[int, nn.Module, int] | None = None
    macs_at: dict[int, int] = {}  # MACs of the candidates tried, by index in `values`

    def meets(i: int) -> bool:
        nonlocal best
        candidate = _compact_at(model, values[i], fold, multiple)
        macs = macs_at[i] = _macs(candidate, size)
        if macs <= budget and (best is None or i < best[0]):
            best = (i, candidate, macs)
        return macs <= budget

    lo, hi = -1, len(values) - 1  # invariant: values[hi] meets the budget, values[lo] (if any) does not
    if not meets(hi):
        least = macs_at[hi]
        raise ValueError(
            f"compact: target_macs={target} ({budget:.6g} MACs) is below what dropping every stripe "
            f"reaches ({least} MACs, {least / dense:.3f} of the dense {dense}); layers without a skeleton cannot be "
            "pruned: raise the target or attach skeletons to more layers"
            + (" (a value above 1 is an absolute MAC count; a share of the dense model is a fraction in (0, 1])"
               if target > 1 else "")
        )
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    i, compact_model, macs = best
    if macs < UNDERSHOOT * budget and i > 0:  # ties: the threshold below keeps too much, this one far too little
        over = macs_at[i - 1]  # tried: the bisection ends with the index below the smallest that meets the budget
        warnings.warn(
            f"compact: target_macs={target}: threshold {values[i]:.8g} meets the budget of {100 * budget / dense:.3g}% of "
            f"the dense MACs with only {100 * macs / dense:.3g}%, and the next lower one ({values[i - 1]:.8g}) keeps "
            f"{100 * over / dense:.3g}%: many stripes share one skeleton value, so no threshold lands nearer. Skeletons "
            "trained longer (or with a larger prune.alpha) spread apart",
            stacklevel=3,
        )
    return compact_model, values[i], macs, dense
