"""PiX (Pick-or-Mix, CVPR 2024): the PiX block and its insertion into ResNets and VGGs.

PiXBlock squeezes C channels to C/zeta: p = sigmoid(W @ avgpool(x)) (B, C/zeta, 1, 1), then the fusion
`kernels.pix(x, p, zeta, tau)` picks the max (p < tau) or the mean (p >= tau) of each contiguous group of
zeta channels, scaled by p (../shared/DESIGN.md "PiX"). With zeta = 1 it is a pure gate, y = p * x.

Two insertion modes (paper supplement, Fig. 1):
- channel squeezing (`insert_pix`): each bottleneck's 1x1 squeeze conv + BN + ReLU becomes a PiXBlock
  (the block is rebuilt as a PiXBottleneck); the bottleneck width becomes out_channels / zeta.
- network downscaling (`downscale_pix`): a PiXBlock goes before each 3x3 conv after the network's first
  conv, and the conv is rebuilt with in_channels / zeta inputs (PiXConv2d).
`apply_pix` picks the mode from the model family.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision.models as tvm

import kernels
from compress.checkpoint import register_module_type
from compress.models._weight_init import init_weights
from compress.models.cifar_resnet import BasicBlock as CifarBasicBlock
from compress.models.cifar_resnet import Bottleneck as CifarBottleneck
from compress.models.cifar_vgg import CifarVGG
from compress.surgery import replace_module

__all__ = ["PiXBlock", "PiXBottleneck", "PiXConv2d", "insert_pix", "downscale_pix", "apply_pix"]


def _check_zeta(where: str, zeta: int) -> None:
    if not isinstance(zeta, int) or isinstance(zeta, bool) or zeta < 1:
        raise ValueError(f"{where}: zeta must be a positive int, got {zeta!r}")


def _check_factor(where: str, channels: int, zeta: int) -> None:
    """Raise a ValueError naming `where` if `channels` cannot be split into groups of `zeta`."""
    _check_zeta(where, zeta)
    if channels % zeta:
        raise ValueError(
            f"{where}: {channels} input channels are not divisible by zeta={zeta}; "
            f"choose a zeta that divides {channels}"
        )


class PiXBlock(nn.Module):
    """PiX squeeze: (B, in_channels, H, W) -> (B, in_channels // zeta, H, W).

    Parameter `weight` (in_channels // zeta, in_channels, 1, 1) is the bias-free 1x1 predictor; it has the
    shape of the squeeze conv it replaces. Under ONNX export the fusion is written with standard ops.
    """

    def __init__(self, in_channels: int, zeta: int, tau: float = 0.5):
        super().__init__()
        _check_factor(f"PiXBlock(in_channels={in_channels})", in_channels, zeta)
        self.in_channels, self.zeta, self.tau = in_channels, zeta, float(tau)
        self.out_channels = in_channels // zeta
        self.weight = nn.Parameter(torch.empty(self.out_channels, in_channels, 1, 1))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv2d's default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"PiXBlock: expected input (B, {self.in_channels}, H, W), got {tuple(x.shape)}; "
                "build the block with the channel count of the tensor it receives"
            )
        p = torch.sigmoid(F.conv2d(x.mean((2, 3), keepdim=True), self.weight))
        if torch.onnx.is_in_onnx_export():
            groups = x.unflatten(1, (self.out_channels, self.zeta))
            return p * torch.where(p < self.tau, groups.amax(2), groups.mean(2))
        return kernels.pix(x, p, self.zeta, self.tau)

    def macs(self, inp: torch.Tensor, out: torch.Tensor) -> int:
        """Real work, 1 add/compare/multiply = 1 MAC: global pool B*C*H*W adds (the 1/HW scale is
        folded into the predictor, not counted), predictor B*C*(C/zeta) multiply-adds, fusion
        B*C*H*W ((zeta - 1) compares or adds plus 1 multiply by p per output element)."""
        b, c, h, w = inp.shape
        return b * c * h * w + b * c * self.out_channels + b * c * h * w

    def config(self) -> dict:
        return {"in_channels": self.in_channels, "zeta": self.zeta, "tau": self.tau}

    def extra_repr(self) -> str:
        return f"{self.in_channels} -> {self.out_channels}, zeta={self.zeta}, tau={self.tau}"


class PiXBottleneck(nn.Module):
    """Bottleneck with PiX in place of the squeeze conv + BN + ReLU:
    (B, in_channels, H, W) -> (B, out_channels, H/stride, W/stride).

    conv1 = PiXBlock(in_channels, zeta) -> conv2 3x3 (in_channels/zeta -> width, carries stride, groups,
    dilation) + bn2 + ReLU -> conv3 1x1 (width -> out_channels) + bn3 -> + shortcut -> ReLU. The shortcut
    is identity, or `downsample` = Sequential(1x1 conv with the stride, BN) when `downsample` is True.
    """

    def __init__(
        self,
        in_channels: int,
        width: int,
        out_channels: int,
        zeta: int,
        tau: float = 0.5,
        stride: int = 1,
        groups: int = 1,
        dilation: int = 1,
        downsample: bool = False,
    ):
        super().__init__()
        self.conv1 = PiXBlock(in_channels, zeta, tau)
        self.conv2 = nn.Conv2d(
            in_channels // zeta, width, 3, stride, dilation, dilation=dilation, groups=groups, bias=False
        )
        self.bn2 = nn.BatchNorm2d(width)
        self.act2 = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )
            if downsample
            else None
        )
        self.act3 = nn.ReLU(inplace=True)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.act2(self.bn2(self.conv2(self.conv1(x))))
        out = self.bn3(self.conv3(out))
        return self.act3(out + shortcut)

    def config(self) -> dict:
        """Constructor kwargs read from the current layers (so a compacted conv2 width is kept)."""
        return {
            "in_channels": self.conv1.in_channels,
            "width": self.conv2.out_channels,
            "out_channels": self.conv3.out_channels,
            "zeta": self.conv1.zeta,
            "tau": self.conv1.tau,
            "stride": self.conv2.stride[0],
            "groups": self.conv2.groups,
            "dilation": self.conv2.dilation[0],
            "downsample": self.downsample is not None,
        }


class PiXConv2d(nn.Module):
    """PiXBlock then a conv with in_channels // zeta inputs (network downscaling mode):
    (B, in_channels, H, W) -> (B, out_channels, Ho, Wo), Ho, Wo as the conv it replaces."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        zeta: int,
        tau: float = 0.5,
        kernel_size: int = 3,
        stride: int = 1,
        padding: int = 1,
        dilation: int = 1,
        bias: bool = False,
    ):
        super().__init__()
        self.pix = PiXBlock(in_channels, zeta, tau)
        self.conv = nn.Conv2d(
            in_channels // zeta, out_channels, kernel_size, stride, padding, dilation=dilation, bias=bias
        )
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pix(x))

    def config(self) -> dict:
        c = self.conv
        return {
            "in_channels": self.pix.in_channels,
            "out_channels": c.out_channels,
            "zeta": self.pix.zeta,
            "tau": self.pix.tau,
            "kernel_size": c.kernel_size[0],
            "stride": c.stride[0],
            "padding": c.padding[0],
            "dilation": c.dilation[0],
            "bias": c.bias is not None,
        }


def _timm_types(name: str) -> tuple[type, ...]:
    try:
        import timm.models.resnet as timm_resnet
    except ImportError:
        return ()
    return (getattr(timm_resnet, name),)


def _bottleneck_types() -> tuple[type, ...]:
    return (tvm.resnet.Bottleneck, CifarBottleneck, *_timm_types("Bottleneck"))


def _basic_block_types() -> tuple[type, ...]:
    return (tvm.resnet.BasicBlock, CifarBasicBlock, *_timm_types("BasicBlock"))


def _square(value: tuple[int, int], what: str, where: str) -> int:
    if value[0] != value[1]:
        raise ValueError(f"{where}: PiX supports square {what} only, got {tuple(value)}")
    return value[0]


def _check_plain_bottleneck(name: str, block: nn.Module) -> None:
    """Raise unless `block` is conv1x1-BN-ReLU, conv3x3-BN-ReLU, conv1x1-BN, (+ conv1x1-BN shortcut), ReLU."""
    where = f"insert_pix: layer '{name}' ({type(block).__module__}.{type(block).__name__})"
    acts = [getattr(block, a) for a in ("relu", "act1", "act2", "act3") if hasattr(block, a)]
    if not acts or not all(type(a) is nn.ReLU for a in acts):
        raise ValueError(
            f"{where}: PiXBottleneck uses ReLU; this block has activations {[type(a).__name__ for a in acts]}"
        )
    for extra in ("se", "drop_path", "aa", "drop_block"):
        mod = getattr(block, extra, None)
        if mod is not None and not isinstance(mod, nn.Identity):
            raise ValueError(
                f"{where}: has '{extra}' = {type(mod).__name__}, which PiXBottleneck would drop; use a plain bottleneck"
            )
    conv1 = block.conv1
    if type(conv1) is not nn.Conv2d or conv1.kernel_size != (1, 1) or conv1.stride != (1, 1):
        raise ValueError(f"{where}: conv1 must be a plain stride-1 1x1 Conv2d (the squeeze), got {conv1}")
    for bn in ("bn1", "bn2", "bn3"):
        if type(getattr(block, bn)) is not nn.BatchNorm2d:
            raise ValueError(f"{where}: {bn} must be BatchNorm2d, got {getattr(block, bn)}")
    ds = block.downsample
    if ds is not None and not (
        isinstance(ds, nn.Sequential)
        and len(ds) == 2
        and type(ds[0]) is nn.Conv2d
        and ds[0].kernel_size == (1, 1)
        and ds[0].bias is None
        and type(ds[1]) is nn.BatchNorm2d
    ):
        raise ValueError(
            f"{where}: downsample must be Sequential(1x1 Conv2d without bias, BatchNorm2d), got {ds}"
        )


def _pix_bottleneck_from(name: str, block: nn.Module, zeta: int, tau: float) -> PiXBottleneck:
    """The PiXBottleneck replacing `block`; conv2/bn2/conv3/bn3 and downsample are reused where their
    shapes are unchanged (zeta = 4 on standard widths), otherwise built fresh."""
    _check_plain_bottleneck(name, block)
    where = f"insert_pix: layer '{name}'"
    in_ch, out_ch = block.conv1.in_channels, block.conv3.out_channels
    if out_ch % zeta:
        raise ValueError(f"{where}: block output channels {out_ch} are not divisible by zeta={zeta}")
    width = out_ch // zeta
    if in_ch % width:
        raise ValueError(
            f"{where}: input channels {in_ch} are not divisible by the new width {width} "
            f"(= output channels {out_ch} / zeta {zeta}); PiX can only squeeze, choose a larger zeta"
        )
    conv2 = block.conv2
    new = PiXBottleneck(
        in_ch,
        width,
        out_ch,
        zeta=in_ch // width,
        tau=tau,
        stride=_square(conv2.stride, "stride", where),
        groups=conv2.groups,
        dilation=_square(conv2.dilation, "dilation", where),
        downsample=block.downsample is not None,
    )
    if new.downsample is not None:
        new.downsample = block.downsample
    if (conv2.in_channels, conv2.out_channels) == (new.conv2.in_channels, new.conv2.out_channels):
        new.conv2, new.bn2, new.conv3, new.bn3 = conv2, block.bn2, block.conv3, block.bn3
    return new


def insert_pix(model: nn.Module, zeta: int, tau: float = 0.5) -> list[str]:
    """Channel squeezing mode, in place: every bottleneck (torchvision, timm, our CIFAR ones) becomes a
    PiXBottleneck of width out_channels / zeta whose squeeze is PiXBlock(in_channels, in_channels / width).

    With standard widths and zeta = 4 the PiX factor is 4, except 1 in stage 1's first block (64 -> 64, a
    pure gate) and 2 in the first block of the later stages (e.g. 256 -> 128). Returns the block names.
    """
    _check_zeta("insert_pix", zeta)
    names = [n for n, m in model.named_modules() if isinstance(m, _bottleneck_types())]
    if not names:
        raise ValueError(f"insert_pix: {type(model).__name__} has no bottleneck block; {_SUPPORTED}")
    for name in names:
        replace_module(model, name, _pix_bottleneck_from(name, model.get_submodule(name), zeta, tau))
    return names


def downscale_pix(model: nn.Module, zeta: int, tau: float = 0.5) -> list[str]:
    """Network downscaling mode, in place: every 3x3 Conv2d after the network's first conv becomes a
    PiXConv2d (PiXBlock(in, zeta) then the conv with in / zeta inputs, freshly initialised).
    Returns the replaced conv names."""
    _check_zeta("downscale_pix", zeta)
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    targets = [(n, m) for n, m in convs[1:] if m.kernel_size == (3, 3)]
    if not targets:
        raise ValueError(f"downscale_pix: {type(model).__name__} has no 3x3 conv after its first conv")
    for name, conv in targets:
        where = f"downscale_pix: layer '{name}'"
        if type(conv) is not nn.Conv2d or conv.groups != 1:
            raise ValueError(f"{where}: expected a plain Conv2d with groups=1, got {conv}")
        _check_factor(where, conv.in_channels, zeta)
        new = PiXConv2d(
            conv.in_channels,
            conv.out_channels,
            zeta,
            tau,
            kernel_size=3,
            stride=_square(conv.stride, "stride", where),
            padding=_square(conv.padding, "padding", where),
            dilation=_square(conv.dilation, "dilation", where),
            bias=conv.bias is not None,
        )
        replace_module(model, name, new)
    return [n for n, _ in targets]


_SUPPORTED = (
    "PiX supports bottleneck ResNets (torchvision resnet50/101/152, timm resnet50/101/152, CIFAR "
    "resnet29_bottleneck/resnet164_bottleneck: channel squeezing), and VGGs (CIFAR vgg*, torchvision vgg*_bn) "
    "and basic-block ResNets (CIFAR resnet20..110, torchvision/timm resnet18/34: network downscaling)"
)


def apply_pix(model: nn.Module, zeta: int, tau: float = 0.5) -> list[str]:
    """Insert PiX in place, choosing the mode from the family (see _SUPPORTED); returns replaced names."""
    modules = list(model.modules())
    if any(isinstance(m, _bottleneck_types()) for m in modules):
        return insert_pix(model, zeta, tau)
    if isinstance(model, (CifarVGG, tvm.VGG)) or any(isinstance(m, _basic_block_types()) for m in modules):
        return downscale_pix(model, zeta, tau)
    raise ValueError(f"apply_pix: unsupported model {type(model).__name__}; {_SUPPORTED}")


for _cls in (PiXBlock, PiXBottleneck, PiXConv2d):
    register_module_type(_cls.__name__, _cls)
