"""CIFAR VGGs with BatchNorm (Simonyan & Zisserman 2015 configurations A, B, D, E).

The CIFAR variant of the network-slimming and SWP code: stacks of conv3x3-BN-ReLU with a 2x2
max-pool after each stage (5 pools: 32x32 -> 1x1), global average pool, and one
Linear(512, num_classes). VGG-16 has 14.7 M params and 313 M MACs at 32x32.
Max-pools use ceil_mode, so inputs smaller than 32x32 also work (a 1x1 map stays 1x1).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._registry import register_model
from ._weight_init import init_weights

__all__ = ["CifarVGG", "VGG_CFGS"]

# Output channels of each conv; "M" is a 2x2 max-pool.
# fmt: off
VGG_CFGS: dict[str, tuple[int | str, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
}
# fmt: on


class CifarVGG(nn.Module):
    """VGG with BN for small images: (B, in_chans, H, W) -> logits (B, num_classes).

    `features` is a flat nn.Sequential (conv, bn, act, ..., pool) as in torchvision, so conv i and
    its BN are `features.<k>` and `features.<k+1>`; `classifier` is the final Linear.

    Args:
        cfg: conv output channels with "M" for a max-pool (see VGG_CFGS).
        conv_layer, norm_layer, act_layer: layer types (act_layer must accept `inplace=`).
    """

    def __init__(
        self,
        cfg: tuple[int | str, ...],
        num_classes: int = 10,
        in_chans: int = 3,
        conv_layer: type[nn.Conv2d] = nn.Conv2d,
        norm_layer: type[nn.Module] = nn.BatchNorm2d,
        act_layer: type[nn.Module] = nn.ReLU,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_chans
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, stride=2, ceil_mode=True))
            else:
                layers += [
                    conv_layer(channels, v, 3, padding=1, bias=False),
                    norm_layer(v),
                    act_layer(inplace=True),
                ]
                channels = v
        self.features = nn.Sequential(*layers)
        self.num_features = channels
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)
        init_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, ceil(H/32), ceil(W/32))."""
        return self.features(x)

    def forward_head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, num_features, h, w) -> (B, num_classes)."""
        return self.classifier(torch.flatten(self.global_pool(x), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _create_cifar_vgg(variant: str, **kwargs) -> CifarVGG:
    return CifarVGG(VGG_CFGS[variant], **kwargs)


@register_model
def vgg11(**kwargs) -> CifarVGG:
    """CIFAR VGG-11 with BN."""
    return _create_cifar_vgg("vgg11", **kwargs)


@register_model
def vgg13(**kwargs) -> CifarVGG:
    """CIFAR VGG-13 with BN."""
    return _create_cifar_vgg("vgg13", **kwargs)


@register_model
def vgg16(**kwargs) -> CifarVGG:
    """CIFAR VGG-16 with BN: 14.7 M params, 313 M MACs at 32x32."""
    return _create_cifar_vgg("vgg16", **kwargs)


@register_model
def vgg19(**kwargs) -> CifarVGG:
    """CIFAR VGG-19 with BN."""
    return _create_cifar_vgg("vgg19", **kwargs)
