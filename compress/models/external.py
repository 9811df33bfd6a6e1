"""torchvision and timm models, built by name with random weights (never downloads).

torchvision: resnet18/34/50/101/152, vgg11_bn/13_bn/16_bn/19_bn, mobilenet_v2 (ImageNet designs;
any input size works). With in_chans != 3 the stem conv is replaced by one with the same
configuration and `in_chans` inputs. timm: any `timm:<name>` through `create_timm_model`.
"""

from __future__ import annotations

import torch.nn as nn

from ._registry import register_model

__all__ = ["create_timm_model"]


def _set_in_chans(model: nn.Module, stem: str, in_chans: int) -> nn.Module:
    """Replace the conv at dotted path `stem` by a freshly initialised one with `in_chans` inputs."""
    if in_chans == 3:
        return model
    old = model.get_submodule(stem)
    new = nn.Conv2d(
        in_chans,
        old.out_channels,
        old.kernel_size,
        stride=old.stride,
        padding=old.padding,
        dilation=old.dilation,
        groups=old.groups,
        bias=old.bias is not None,
    )
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    parent, _, child = stem.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
    return model


def _create_torchvision(name: str, stem: str, num_classes: int, in_chans: int, **kwargs) -> nn.Module:
    import torchvision.models as tvm

    model = getattr(tvm, name)(weights=None, num_classes=num_classes, **kwargs)
    return _set_in_chans(model, stem, in_chans)


def create_timm_model(name: str, num_classes: int = 10, in_chans: int = 3, **kwargs) -> nn.Module:
    """timm.create_model(name, pretrained=False, ...); ValueError if timm has no such model."""
    import timm

    if not timm.is_model(name):
        raise ValueError(
            f"create_model: timm has no model {name!r}; see timm.list_models('{name}*') for close names"
        )
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_chans, **kwargs)


@register_model
def resnet18(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision ResNet-18."""
    return _create_torchvision("resnet18", "conv1", num_classes, in_chans, **kwargs)


@register_model
def resnet34(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision ResNet-34."""
    return _create_torchvision("resnet34", "conv1", num_classes, in_chans, **kwargs)


@register_model
def resnet50(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision ResNet-50: 25.56 M params, 4.1 GMACs at 224x224 (1000 classes)."""
    return _create_torchvision("resnet50", "conv1", num_classes, in_chans, **kwargs)


@register_model
def resnet101(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision ResNet-101."""
    return _create_torchvision("resnet101", "conv1", num_classes, in_chans, **kwargs)


@register_model
def resnet152(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision ResNet-152."""
    return _create_torchvision("resnet152", "conv1", num_classes, in_chans, **kwargs)


@register_model
def vgg11_bn(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision VGG-11 with BN (ImageNet head: 7x7 adaptive pool, 3 Linear layers)."""
    return _create_torchvision("vgg11_bn", "features.0", num_classes, in_chans, **kwargs)


@register_model
def vgg13_bn(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision VGG-13 with BN."""
    return _create_torchvision("vgg13_bn", "features.0", num_classes, in_chans, **kwargs)


@register_model
def vgg16_bn(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision VGG-16 with BN."""
    return _create_torchvision("vgg16_bn", "features.0", num_classes, in_chans, **kwargs)


@register_model
def vgg19_bn(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision VGG-19 with BN."""
    return _create_torchvision("vgg19_bn", "features.0", num_classes, in_chans, **kwargs)


@register_model
def mobilenet_v2(num_classes: int = 1000, in_chans: int = 3, **kwargs) -> nn.Module:
    """torchvision MobileNetV2."""
    return _create_torchvision("mobilenet_v2", "features.0.0", num_classes, in_chans, **kwargs)
