"""PiX (Pick-or-Mix, CVPR 2024): the PiX block and its insertion into ResNets and VGGs.

PiXBlock squeezes C channels to C/zeta: p = sigmoid(W @ avgpool(x)) (B, C/zeta, 1, 1), then the fusion
`kernels.pix(x, p, zeta, tau)` (both in one op, `kernels.pix_squeeze`, whose backward adds the pooling gradient
inside the dx kernel) picks the max (p < tau) or the mean (p >= tau) of each contiguous group of
zeta channels, scaled by p (../shared/DESIGN.md "PiX"). With zeta = 1 it is a pure gate, y = p * x.

Two insertion modes (paper supplement, Fig. 1), both in place and by module replacement only (blocks keep
their class and forward, so checkpoints, torch.fx surgery and skeletons see ordinary convs around PiX):
- channel squeezing (`insert_pix`): each bottleneck's 1x1 squeeze conv + BN + ReLU becomes a PiXBlock;
  the bottleneck width becomes out_channels / zeta.
- network downscaling (`downscale_pix`): a PiXBlock goes before each 3x3 conv after the network's first
  conv, and the conv is rebuilt with in_channels / zeta inputs (Sequential(PiXBlock, conv)).
`apply_pix` picks the mode from the model family.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn

import kernels
from compress._checks import positive_int, refuse_wrapper
from compress.models._weight_init import init_weights
from compress.models.cifar_resnet import BasicBlock as CifarBasicBlock
from compress.models.cifar_resnet import Bottleneck as CifarBottleneck
from compress.models.cifar_vgg import CifarVGG
from compress.surgery import imported_classes, replace_module
from kernels import residual_relu
from kernels._utils import (
    check_tau,
    eager_inference,
    fx_tracing,
    is_channels_last,
    plain_eager,
    unobserved,
)
from kernels.pix import pix_squeeze_ops, squeeze_cpu_call

__all__ = ["PiXBlock", "ResidualReLU", "insert_pix", "use_pix_bottlenecks", "downscale_pix", "apply_pix"]


def _check_zeta(where: str, zeta: int) -> int:
    return positive_int(where, "zeta", zeta)


def _refuse_compacted(where: str, model: nn.Module) -> None:
    """ValueError for a compacted model (`compress.compact`'s output, a loaded compact file): pruning fixed its layer
    widths (and folding removed its BNs), so the squeeze factors PiX needs no longer hold; PiX goes in first."""
    if hasattr(model, "compress_compaction"):
        raise ValueError(f"{where}: the model is compacted already (compress.compact, or a compact file), its widths "
                         "fixed by the pruning; insert PiX into the dense model, then train with SWP and compact "
                         "(train.py: pix.zeta=4 prune=swp)")


def _check_factor(where: str, channels: int, zeta: int) -> int:
    """zeta as an int; a ValueError naming `where` if `channels` cannot be split into groups of `zeta`."""
    zeta = _check_zeta(where, zeta)
    if channels % zeta:
        raise ValueError(
            f"{where}: {channels} input channels are not divisible by zeta={zeta}; "
            f"choose a zeta that divides {channels}"
        )
    return zeta


class PiXBlock(nn.Module):
    """PiX squeeze: (B, in_channels, H, W) -> (B, in_channels // zeta, H, W).

    Parameter `weight` (in_channels // zeta, in_channels, 1, 1) is the bias-free 1x1 predictor; it has the
    shape of the squeeze conv it replaces. Under ONNX export the fusion is written with standard ops.
    """

    def __init__(self, in_channels: int, zeta: int, tau: float = 0.5):
        super().__init__()
        in_channels = positive_int("PiXBlock", "in_channels", in_channels)
        zeta = _check_factor(f"PiXBlock(in_channels={in_channels})", in_channels, zeta)
        self.in_channels, self.zeta, self.tau = in_channels, zeta, tau  # (tau checked by __setattr__)
        self.out_channels = in_channels // zeta
        self.weight = nn.Parameter(torch.empty(self.out_channels, in_channels, 1, 1))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv2d's default
        self._direct: tuple | None = None  # `_eager_cpu_output`'s (weight, its data_ptr and shape, x dtype, call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, H, W) -> (B, C // zeta, H, W); an unbatched x (C, H, W) -> (C // zeta, H, W). Under torch.fx
        symbolic tracing: one `compress::pix_squeeze` op call (batched x)."""
        if fx_tracing():
            return torch.ops.compress.pix_squeeze(x, self.weight, self.zeta, self.tau)[0]
        y = self._eager_cpu_output(x)
        if y is not None:
            return y
        if x.dim() not in (3, 4) or (not torch.jit.is_tracing() and x.shape[-3] != self.in_channels):  # (no TracerWarning)
            raise ValueError(
                f"PiXBlock: expected input (B, {self.in_channels}, H, W) or ({self.in_channels}, H, W), got "
                f"{tuple(x.shape)}; build the block with the channel count of the tensor it receives"
            )
        if x.dim() == 3:
            return self.forward(x.unsqueeze(0)).squeeze(0)
        # ONNX export (standard ops) always traces (not plain eager); is_in_onnx_export() itself costs two imports
        # per call, about 20 us per block in a CPU batch-1 forward, so plain eager calls skip it. (Under torch.func
        # transforms and forward-mode AD kernels.pix_squeeze takes the same standard ops itself.)
        if not plain_eager(x, self.weight) and torch.onnx.is_in_onnx_export():
            return pix_squeeze_ops(x, self.weight, self.zeta, self.tau)
        return kernels.pix_squeeze(x, self.weight, self.zeta, self.tau)

    def _eager_cpu_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The block in plain, unobserved eager CPU inference (`eager_inference`, `unobserved`) through the C++ call
        `kernels.pix.squeeze_cpu_call` bound to the current weight, whose memory it reads (bound again when the
        weight is another tensor, at another address or of another shape, or x's dtype changes; a weight of
        another dtype than x's, or not contiguous, takes the op); None elsewhere. The same C++ function as the op's
        path, so the same bits. Why: the op's path checks its arguments and the calling state in several frames on
        every call; in a batch-1 PiX ResNet-50 forward on the 2-core CPU host (2 threads, NCHW) this path lifted the
        ratio over ResNet-50 by about 0.02 (1.196x -> 1.215x, 1.206x -> 1.226x, 1.205x -> 1.222x in three
        interleaved runs; benchmarks/results/pix_cpu_direct_session39.json)."""
        if not (x.is_cpu and eager_inference() and unobserved()):
            return None
        weight = self._parameters.get("weight")  # (.get: a parametrization takes it out of _parameters)
        kept = self._direct
        if (kept is None or kept[0] is not weight or weight.data_ptr() != kept[1] or weight.shape != kept[2]
                or kept[3] is not x.dtype or not weight.is_contiguous()):  # (is_contiguous: `.data = w.t()`)
            if weight is None or x.dtype not in (torch.float32, torch.float64):
                return None
            call = squeeze_cpu_call(weight, x.dtype, self.zeta, self.tau)
            if call is None:
                return None
            kept = self._direct = (weight, weight.data_ptr(), weight.shape, x.dtype, call)
        return kept[4](x)

    def __setattr__(self, name: str, value) -> None:
        if name == "tau":
            check_tau("PiXBlock", value)
            value = float(value)
        super().__setattr__(name, value)
        if name in ("zeta", "tau", "in_channels"):  # (bound in the direct call)
            self.__dict__["_direct"] = None

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["_direct"] = None  # (a closure: not picklable, and a copy binds its own weight)
        return state

    def macs(self, inp: torch.Tensor, out: torch.Tensor) -> int:
        """Real work, 1 add/compare/multiply = 1 MAC: global pool B*C*H*W adds (the 1/HW scale is
        folded into the predictor, not counted), predictor B*C*(C/zeta) multiply-adds, fusion
        B*C*H*W ((zeta - 1) compares or adds plus 1 multiply by p per output element)."""
        return pix_macs(inp.shape, self.out_channels)

    def config(self) -> dict:
        return {"in_channels": self.in_channels, "zeta": self.zeta, "tau": self.tau}

    def extra_repr(self) -> str:
        return f"{self.in_channels} -> {self.out_channels}, zeta={self.zeta}, tau={self.tau}"


def pix_macs(x_shape: Sequence[int], groups: int) -> int:
    """`PiXBlock.macs` for an input of shape x_shape (B, C, H, W) and `groups` = C / zeta output channels."""
    b, c, h, w = x_shape
    return b * c * h * w + b * c * groups + b * c * h * w


def _bottleneck_types() -> tuple[type, ...]:
    return (CifarBottleneck, *imported_classes("torchvision.models.resnet", "Bottleneck"),
            *imported_classes("timm.models.resnet", "Bottleneck"))


def _basic_block_types() -> tuple[type, ...]:
    return (CifarBasicBlock, *imported_classes("torchvision.models.resnet", "BasicBlock"),
            *imported_classes("timm.models.resnet", "BasicBlock"))


def _check_resizable(module: nn.Module, where: str) -> None:
    if type(module) not in (nn.Conv2d, nn.BatchNorm2d):
        fix = ("; apply PiX to the model before compress.attach_skeletons (train.py does: pix.zeta with prune=swp)"
               if hasattr(module, "skeleton") else "")
        raise ValueError(
            f"{where}: expected a plain Conv2d or BatchNorm2d to resize, got {type(module).__name__}{fix}"
        )


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    """`new` made to fit where `old` was: on its device, in its float dtype and memory format, in its train/eval
    mode, and frozen when all of `old`'s parameters are."""
    tensors = [*old.parameters(), *old.buffers()]
    ref = next((t for t in tensors if t.is_floating_point()), tensors[0] if tensors else None)
    if ref is not None:
        new.to(device=ref.device, dtype=ref.dtype if ref.is_floating_point() else None,
               memory_format=torch.channels_last if is_channels_last(ref) else torch.preserve_format)
    params = list(old.parameters())
    if params and not any(p.requires_grad for p in params):
        new.requires_grad_(False)
    return new.train(old.training)


def _resized(module: nn.Module, in_channels: int, out_channels: int) -> nn.Module:
    """A freshly initialised copy of a plain Conv2d (same kernel, stride, padding, dilation, groups, bias)
    or BatchNorm2d (same eps, momentum, affine, running statistics) with new channel counts (`_check_resizable`
    checked the type), fitted to `module` by `_like`."""
    if type(module) is nn.BatchNorm2d:
        new = nn.BatchNorm2d(out_channels, eps=module.eps, momentum=module.momentum, affine=module.affine,
                             track_running_stats=module.track_running_stats)
    elif type(module) is nn.Conv2d:
        new = nn.Conv2d(
            in_channels,
            out_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
            module.bias is not None,
            module.padding_mode,
        )
    init_weights(new)
    return _like(new, module)


def traced_residual_relu(out: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
    """`kernels.residual_relu` on a copy of `out`: what a torch.fx graph of ResidualReLU calls (a leaf: its fast path
    branches). A graph's values may be returned or read by other nodes (a feature extractor's `bn3` output), so the
    graph must not overwrite them; torchvision's `out += identity` traces as an out-of-place add too."""
    return residual_relu(out.clone(), identity)


torch.fx.wrap("traced_residual_relu")


class ResidualReLU(nn.Module):
    """relu(out + identity), `kernels.residual_relu`, as a module (no parameters): PiXBottleneck's tail, so that
    profilers see its ReLU as they see the dense Bottleneck's (`compress.profile`'s "paper" convention counts 1 per
    output element). Overwrites `out` in eager mode, as torchvision's tail does; not in torch.fx graphs."""

    def forward(self, out: torch.Tensor, identity: torch.Tensor) -> torch.Tensor:
        if fx_tracing():
            return traced_residual_relu(out, identity)
        return residual_relu(out, identity)


def use_pix_bottlenecks(model: nn.Module) -> int:
    """Give every torchvision Bottleneck of `model` that is a PiX block the PiXBottleneck forward and a `residual`
    module, in place; returns how many. `insert_pix` calls it once conv1 is a PiXBlock; `compress.load` on blocks
    that have their `residual` (saved as a Bottleneck with it), whatever conv1 became: compaction replaces a PiX block
    no conv reads by a `ZeroChannels`, and such a block's `relu` may be an Identity (`fuse_relu`), which only
    PiXBottleneck's forward, where `residual` applies the last ReLU, computes right."""
    bottleneck = imported_classes("torchvision.models.resnet", "Bottleneck")
    blocks = [m for m in model.modules() if type(m) in bottleneck
              and (isinstance(m.conv1, PiXBlock) or isinstance(getattr(m, "residual", None), ResidualReLU))]
    if not blocks:
        return 0
    from compress._pix_torchvision import PiXBottleneck  # torchvision is imported: the blocks are its

    for block in blocks:
        block.__class__ = PiXBottleneck
        if not isinstance(getattr(block, "residual", None), ResidualReLU):
            block.residual = ResidualReLU().train(block.training)
    return len(blocks)


def _squeeze_width(name: str, block: nn.Module, zeta: int) -> int:
    """Check that `insert_pix` can squeeze `block` at `zeta` (ValueError naming the layer otherwise); return its new
    bottleneck width, out_channels / zeta. Changes nothing."""
    where = f"insert_pix: layer '{name}' ({type(block).__module__}.{type(block).__name__})"
    conv1, conv2, conv3 = block.conv1, block.conv2, block.conv3
    if isinstance(conv1, PiXBlock):
        raise ValueError(f"{where}: has a PiX block already; apply PiX once, to the model without them")
    if (
        type(conv1) is not nn.Conv2d
        or conv1.kernel_size != (1, 1)
        or conv1.stride != (1, 1)
        or conv1.groups != 1
    ):
        raise ValueError(f"{where}: conv1 must be the squeeze, a plain stride-1 1x1 Conv2d; got {conv1}")
    act = getattr(block, "act1", getattr(block, "relu", None))
    if type(act) is not nn.ReLU or type(block.bn1) is not nn.BatchNorm2d:
        raise ValueError(
            f"{where}: PiX replaces a squeeze conv + BatchNorm2d + ReLU; this block has "
            f"{type(block.bn1).__name__} and {type(act).__name__}"
        )
    in_ch, out_ch = conv1.in_channels, conv3.out_channels
    if out_ch % zeta:
        raise ValueError(f"{where}: block output channels {out_ch} are not divisible by zeta={zeta}; choose a zeta "
                         f"that divides {out_ch} (4: the standard widths, 8: the thin network)")
    width = out_ch // zeta
    if in_ch % width:
        raise ValueError(
            f"{where}: input channels {in_ch} are not divisible by the new width {width} "
            f"(= output channels {out_ch} / zeta {zeta}); PiX can only squeeze, choose a larger zeta"
        )
    if (conv2.in_channels, conv2.out_channels) != (width, width):
        aa = getattr(block, "aa", None)  # timm's anti-aliasing after conv2: AvgPool2d takes any width as it is
        if aa is not None and (any(True for _ in aa.parameters()) or any(True for _ in aa.buffers())):
            raise ValueError(
                f"{where}: cannot change the width with anti-aliasing that holds per-channel tensors "
                f"({type(aa).__name__}); only zeta={out_ch // conv2.out_channels} keeps this block's width "
                f"{conv2.out_channels}"
            )
        if width % conv2.groups:
            raise ValueError(f"{where}: new width {width} is not divisible by conv2's groups={conv2.groups}")
        for part in ("conv2", "bn2", "conv3"):
            _check_resizable(getattr(block, part), f"{where} {part}")
    return width


def _squeeze_with_pix(block: nn.Module, width: int, tau: float) -> None:
    """Replace `block`'s squeeze conv1 + bn1 + act1 by PiXBlock(in, in / width) and resize conv2, bn2 and conv3's
    input to `width` when it differs from the current one (`_squeeze_width` checked it all).

    torchvision's Bottleneck applies one shared ReLU after bn1, bn2 and the residual sum; it stays after
    PiX and is exact there: the block input is the output of a ReLU (previous block or stem), so PiX's
    p * max / p * mean with p > 0 is non-negative and the ReLU leaves it unchanged.
    """
    in_ch = block.conv1.in_channels
    block.conv1, block.bn1 = _like(PiXBlock(in_ch, in_ch // width, tau), block.conv1), nn.Identity().train(block.training)
    if hasattr(block, "act1"):
        block.act1 = nn.Identity().train(block.training)
    if (block.conv2.in_channels, block.conv2.out_channels) != (width, width):
        block.conv2 = _resized(block.conv2, width, width)
        block.bn2 = _resized(block.bn2, width, width)
        block.conv3 = _resized(block.conv3, width, block.conv3.out_channels)


def _record(model: nn.Module, zeta: int, tau: float) -> None:
    """A model from `create_model` records PiX in `compress_arch["pix"]` ({"zeta", "tau"}), so that checkpoints and
    compact files say which architecture they hold (export rebuilds the dense baseline from it)."""
    arch = getattr(model, "compress_arch", None)
    if isinstance(arch, dict):
        arch["pix"] = {"zeta": int(zeta), "tau": float(tau)}


def _modules_with_hooks(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of `model`'s modules with forward or backward hooks of their own, in model order."""
    return {name: m for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks}


def _warn_dropped_hooks(where: str, model: nn.Module, with_hooks: dict[str, nn.Module]) -> None:
    """Warn naming the modules of `with_hooks` (name: module with hooks of its own, before PiX went in) that are no
    longer in `model`: PiX replaced or rebuilt them, and their hooks went with them."""
    present = {id(m) for m in model.modules()}
    gone = [name for name, m in with_hooks.items() if id(m) not in present]
    if gone:
        warnings.warn(f"{where}: {', '.join(gone[:5])}{', ...' if len(gone) > 5 else ''}: PiX replaced or rebuilt "
                      "these modules, and the hooks registered on them went with them; register them again "
                      "on the new modules", stacklevel=3)


def insert_pix(model: nn.Module, zeta: int, tau: float = 0.5) -> list[str]:
    """Channel squeezing mode, in place: in every bottleneck (torchvision, timm, our CIFAR ones) PiX replaces
    the squeeze conv + BN + ReLU, and the bottleneck width becomes out_channels / zeta (conv2, bn2 and conv3 are
    rebuilt, freshly initialised, where that changes it: at zeta 8, or at zeta 4 and 8 for bottlenecks wider than
    out_channels / 4 such as wide_resnet50_2's and resnext50_32x4d's, which cannot take zeta 2: stage 1's first
    block would have to widen 64 input channels to 128).

    The PiX factor of a block is in_channels / width. With zeta = 4 (standard widths) it is 4, except 1 in
    stage 1's first block (64 -> 64: a pure gate, y = p * x) and 2 in the first block of the later stages
    (e.g. 256 -> 128). With zeta = 8 (thin): 2 in stage 1's first block (64 -> 32), 4 in the other first
    blocks, 8 elsewhere. Every block is checked before any changes: an error leaves the model as it was.
    Records PiX in `model.compress_arch` (see `_record`). Returns the names of the changed blocks.
    """
    refuse_wrapper("insert_pix", model, "insert PiX into")
    zeta = _check_zeta("insert_pix", zeta)
    check_tau("insert_pix", tau)
    _refuse_compacted("insert_pix", model)
    names = [n for n, m in model.named_modules() if isinstance(m, _bottleneck_types())]
    if not names:
        raise _unsupported(f"insert_pix: {type(model).__name__} has no bottleneck block PiX rebuilds", model)
    widths = [_squeeze_width(name, model.get_submodule(name), zeta) for name in names]
    with_hooks = _modules_with_hooks(model)
    for name, width in zip(names, widths):
        _squeeze_with_pix(model.get_submodule(name), width, tau)
    use_pix_bottlenecks(model)
    _warn_dropped_hooks("insert_pix", model, with_hooks)
    _record(model, zeta, tau)
    return names


def downscale_pix(model: nn.Module, zeta: int, tau: float = 0.5) -> list[str]:
    """Network downscaling mode, in place: every 3x3 Conv2d after the network's first conv becomes
    Sequential(PiXBlock(in, zeta), the conv with in / zeta inputs, freshly initialised; at zeta 1 the conv itself,
    whose weights still fit). Every conv is checked before any changes; records PiX in `model.compress_arch`.
    Returns the names of the replaced convs."""
    refuse_wrapper("downscale_pix", model, "insert PiX into")
    zeta = _check_zeta("downscale_pix", zeta)
    check_tau("downscale_pix", tau)
    _refuse_compacted("downscale_pix", model)
    if any(isinstance(m, PiXBlock) for m in model.modules()):
        raise ValueError(f"downscale_pix: {type(model).__name__} has PiX blocks already; apply PiX once, to the "
                         "model without them")
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    targets = [(n, m) for n, m in convs[1:] if m.kernel_size == (3, 3)]
    if not targets:
        raise ValueError(f"downscale_pix: {type(model).__name__} has no 3x3 conv after its first conv")
    for name, conv in targets:
        where = f"downscale_pix: layer '{name}'"
        if conv.groups != 1:
            raise ValueError(f"{where}: PiX needs a conv with groups=1, got groups={conv.groups}")
        _check_factor(where, conv.in_channels, zeta)
        _check_resizable(conv, where)
    with_hooks = _modules_with_hooks(model)
    for name, conv in targets:
        new_conv = conv if zeta == 1 else _resized(conv, conv.in_channels // zeta, conv.out_channels)
        replace_module(model, name, _like(nn.Sequential(PiXBlock(conv.in_channels, zeta, tau), new_conv), conv))
    _warn_dropped_hooks("downscale_pix", model, with_hooks)
    _record(model, zeta, tau)
    return [n for n, _ in targets]


_SUPPORTED = (
    "PiX supports bottleneck ResNets (torchvision resnet50/101/152, wide and ResNeXt ones; timm resnet50/101/152 "
    "and their d/t stems, SE, ECA and ResNeXt variants; CIFAR "
    "resnet29_bottleneck/resnet164_bottleneck: channel squeezing), and VGGs (CIFAR vgg*, torchvision vgg*) "
    "and basic-block ResNets (CIFAR resnet20..110, torchvision/timm resnet18/34: network downscaling)"
)


def apply_pix(model: nn.Module, zeta: int, tau: float = 0.5) -> list[str]:
    """Insert PiX in place, choosing the mode from the family (see _SUPPORTED); returns the changed names. A model
    from `create_model` records it in `compress_arch["pix"]` (see `_record`). A torch.compile, DataParallel, DDP or
    CUDAGraphModel wrapper is refused, naming the model inside (PiX went into it, but the record onto the wrapper)."""
    refuse_wrapper("apply_pix", model, "insert PiX into")
    modules = list(model.modules())
    if any(isinstance(m, _bottleneck_types()) for m in modules):
        changed = insert_pix(model, zeta, tau)
    elif any(isinstance(m, (CifarVGG, *imported_classes("torchvision.models", "VGG"), *_basic_block_types())) for m in modules):
        changed = downscale_pix(model, zeta, tau)
    else:
        raise _unsupported(f"apply_pix: unsupported model {type(model).__name__}", model)
    return changed


def _unsupported(head: str, model: nn.Module) -> ValueError:
    """The error for a model PiX cannot take, naming its blocks (timm's SK, ResNeSt and Res2Net bottlenecks)."""
    blocks = sorted({type(m).__name__ for m in model.modules()
                     if type(m).__name__.lower().endswith(("neck", "block", "basic"))})  # timm: SelectiveKernelBasic
    has = f" (its blocks are {', '.join(blocks)}, which PiX does not rebuild)" if blocks else ""
    return ValueError(f"{head}{has}; {_SUPPORTED}")




def __getattr__(name: str):
    """`compress.pix.PiXBottleneck`, defined in compress._pix_torchvision on torchvision's Bottleneck and imported on
    first use: importing torchvision takes seconds (its ops import torch._dynamo), which CIFAR runs never need."""
    if name == "PiXBottleneck":
        from compress._pix_torchvision import PiXBottleneck

        return PiXBottleneck
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
