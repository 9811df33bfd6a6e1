"""CIFAR ResNets (He et al., "Deep Residual Learning for Image Recognition", 2016, section 4.2).

Basic-block nets resnet20/32/56/110 (depth 6n+2): a 3x3 stem conv with 16 channels, three stages
of n blocks with 16/32/64 channels (stride 2 at the start of stages 2 and 3), global average pool
and one Linear. Shortcuts are option A, parameter-free: subsample by the stride and zero-pad the
new channels, so ResNet-56 has 0.85 M params and 125 M MACs at 32x32.

Bottleneck nets resnet29_bottleneck/resnet164_bottleneck (depth 9n+2): stages of n bottlenecks
with widths 16/32/64 and expansion 4 (outputs 64/128/256); a projection shortcut (1x1 conv + BN,
named `downsample`) wherever the shape changes. The first 1x1 conv of each bottleneck (`conv1`,
`bn1`, `act1`) is a channel squeeze that PiX can replace. The last BN of each bottleneck (`bn3`)
starts at weight 0 by default (`zero_init_last`, as timm and Goyal et al. 2017), so every residual
branch starts as the identity: without it the bottleneck nets diverged on the digits default (epoch-1
loss 3.4 at lr 0.1) and PiX + SWP reached only ~0.31 test accuracy.

Attribute names follow torchvision (`conv1, bn1, conv2, bn2[, conv3, bn3], downsample`), with
separate activations `act1, act2[, act3]` as in timm so each one can be replaced by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._registry import register_model
from ._weight_init import init_weights

__all__ = ["CifarResNet", "BasicBlock", "Bottleneck", "PadShortcut"]


class PadShortcut(nn.Module):
    """Option-A shortcut: (B, C_in, H, W) -> (B, C_out, ceil(H/s), ceil(W/s)) by taking every s-th
    pixel and zero-padding the channels (C_out - C_in new channels, split evenly before and after)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        if out_channels < in_channels:
            raise ValueError(f"PadShortcut: out_channels ({out_channels}) < in_channels ({in_channels})")
        self.in_channels, self.out_channels, self.stride = in_channels, out_channels, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.out_channels - self.in_channels
        return F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, pad // 2, pad - pad // 2))

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, stride={self.stride}"


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers and a residual: (B, inplanes, H, W) -> (B, planes, H/stride, W/stride)."""

    expansion = 1

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        conv_layer: type[nn.Conv2d] = nn.Conv2d,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
        act_layer: type[nn.Module] = nn.ReLU,
    ):
        super().__init__()
        self.conv1 = conv_layer(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(planes)
        self.act1 = act_layer(inplace=True)
        self.conv2 = conv_layer(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample
        self.act2 = act_layer(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return self.act2(x + shortcut)


class Bottleneck(nn.Module):
    """1x1 squeeze, 3x3 (carries the stride), 1x1 expand (x4) and a residual:
    (B, inplanes, H, W) -> (B, 4 * planes, H/stride, W/stride)."""

    expansion = 4

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        conv_layer: type[nn.Conv2d] = nn.Conv2d,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
        act_layer: type[nn.Module] = nn.ReLU,
    ):
        super().__init__()
        outplanes = planes * self.expansion
        self.conv1 = conv_layer(inplanes, planes, 1, bias=False)
        self.bn1 = norm_layer(planes)
        self.act1 = act_layer(inplace=True)
        self.conv2 = conv_layer(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.act2 = act_layer(inplace=True)
        self.conv3 = conv_layer(planes, outplanes, 1, bias=False)
        self.bn3 = norm_layer(outplanes)
        self.downsample = downsample
        self.act3 = act_layer(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.act2(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        return self.act3(x + shortcut)


class CifarResNet(nn.Module):
    """ResNet for small (e.g. 32x32) images: (B, in_chans, H, W) -> logits (B, num_classes).

    Args:
        block: BasicBlock or Bottleneck.
        layers: blocks per stage.
        widths: planes per stage (block outputs are `planes * block.expansion`).
        shortcut: "pad" (option A, parameter-free) or "conv" (1x1 conv + BN projection) where the
            shape changes.
        conv_layer, norm_layer, act_layer: layer types used throughout (e.g. a skeleton conv).
        zero_init_last: start the last norm layer of every residual branch (`bn3` of a Bottleneck,
            `bn2` of a BasicBlock) at weight 0. Default (None): True for Bottleneck, False for
            BasicBlock (the published CIFAR ResNet-20..110 recipe initialises it to 1).
    """

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        layers: tuple[int, ...],
        num_classes: int = 10,
        in_chans: int = 3,
        widths: tuple[int, ...] = (16, 32, 64),
        shortcut: str = "pad",
        conv_layer: type[nn.Conv2d] = nn.Conv2d,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
        act_layer: type[nn.Module] = nn.ReLU,
        zero_init_last: bool | None = None,
    ):
        super().__init__()
        if shortcut not in ("pad", "conv"):
            raise ValueError(f"CifarResNet: shortcut must be 'pad' or 'conv', got {shortcut!r}")
        if len(layers) != len(widths):
            raise ValueError(f"CifarResNet: {len(layers)} stage depths for {len(widths)} stage widths")
        layer_types = dict(conv_layer=conv_layer, norm_layer=norm_layer, act_layer=act_layer)
        self.conv1 = conv_layer(in_chans, widths[0], 3, padding=1, bias=False)
        self.bn1 = norm_layer(widths[0])
        self.act1 = act_layer(inplace=True)
        inplanes = widths[0]
        for i, (depth, planes) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                outplanes = planes * block.expansion
                downsample = None
                if stride != 1 or inplanes != outplanes:
                    if shortcut == "pad":
                        downsample = PadShortcut(inplanes, outplanes, stride)
                    else:
                        downsample = nn.Sequential(
                            conv_layer(inplanes, outplanes, 1, stride=stride, bias=False),
                            norm_layer(outplanes),
                        )
                blocks.append(block(inplanes, planes, stride, downsample, **layer_types))
                inplanes = outplanes
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.num_stages = len(layers)
        self.num_features = inplanes
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)
        init_weights(self)
        if zero_init_last is None:
            zero_init_last = block is Bottleneck
        if zero_init_last:
            last = "bn3" if issubclass(block, Bottleneck) else "bn2"
            for m in self.modules():
                if isinstance(m, block) and getattr(getattr(m, last), "weight", None) is not None:
                    nn.init.zeros_(getattr(m, last).weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, H/4, W/4) for three stages."""
        x = self.act1(self.bn1(self.conv1(x)))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return x

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, num_features, h, w) -> (B, num_classes)."""
        return self.fc(torch.flatten(self.global_pool(x), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _create_cifar_resnet(depth: int, bottleneck: bool, **kwargs) -> CifarResNet:
    """Depth 6n+2 with basic blocks and option-A shortcuts, or 9n+2 with bottlenecks and projections."""
    per_block, block = (9, Bottleneck) if bottleneck else (6, BasicBlock)
    if (depth - 2) % per_block:
        raise ValueError(f"CIFAR ResNet depth must be {per_block}n+2, got {depth}")
    n = (depth - 2) // per_block
    kwargs.setdefault("shortcut", "conv" if bottleneck else "pad")
    return CifarResNet(block, (n, n, n), **kwargs)


@register_model
def resnet20(**kwargs) -> CifarResNet:
    """CIFAR ResNet-20: 0.27 M params."""
    return _create_cifar_resnet(20, bottleneck=False, **kwargs)


@register_model
def resnet32(**kwargs) -> CifarResNet:
    """CIFAR ResNet-32: 0.46 M params."""
    return _create_cifar_resnet(32, bottleneck=False, **kwargs)


@register_model
def resnet56(**kwargs) -> CifarResNet:
    """CIFAR ResNet-56: 0.85 M params, 125 M MACs at 32x32."""
    return _create_cifar_resnet(56, bottleneck=False, **kwargs)


@register_model
def resnet110(**kwargs) -> CifarResNet:
    """CIFAR ResNet-110: 1.7 M params."""
    return _create_cifar_resnet(110, bottleneck=False, **kwargs)


@register_model
def resnet29_bottleneck(**kwargs) -> CifarResNet:
    """CIFAR bottleneck ResNet-29 (3 bottlenecks per stage, outputs 64/128/256)."""
    return _create_cifar_resnet(29, bottleneck=True, **kwargs)


@register_model
def resnet164_bottleneck(**kwargs) -> CifarResNet:
    """CIFAR bottleneck ResNet-164 (18 bottlenecks per stage, outputs 64/128/256)."""
    return _create_cifar_resnet(164, bottleneck=True, **kwargs)
