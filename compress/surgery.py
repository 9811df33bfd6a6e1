"""Model surgery: find, replace and pair modules by their qualified names."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["get_module", "replace_module", "conv_bn_pairs"]


def get_module(model: nn.Module, name: str) -> nn.Module:
    """Return the submodule at dotted path `name` ('' is the model itself)."""
    return model.get_submodule(name) if name else model


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put `new` at dotted path `name` and return the module it replaced."""
    if not name:
        raise ValueError("replace_module: cannot replace the root module; build a new model instead")
    parent_name, _, child = name.rpartition(".")
    parent = get_module(model, parent_name)
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def conv_bn_pairs(model: nn.Module) -> dict[str, str]:
    """Map each Conv2d to the BatchNorm2d that normalises its output.

    A BatchNorm2d is paired with the Conv2d registered directly before it when its `num_features`
    equals the conv's `out_channels`. This holds for our CIFAR models and for torchvision's and
    timm's ResNets, VGGs and MobileNets, where a conv's BN is the next module in registration order.
    """
    pairs: dict[str, str] = {}
    prev_conv: tuple[str, nn.Conv2d] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            prev_conv = (name, module)
        elif isinstance(module, nn.BatchNorm2d):
            if prev_conv is not None and prev_conv[1].out_channels == module.num_features:
                pairs[prev_conv[0]] = name
            prev_conv = None
        elif len(module._modules) == 0 and not isinstance(module, (nn.ReLU, nn.Identity)):
            prev_conv = None
    return pairs
