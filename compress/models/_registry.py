"""Model registry: entry points registered by name, and the one public constructor `create_model`."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch.nn as nn

__all__ = ["register_model", "list_models", "create_model"]

TIMM_PREFIX = "timm:"

_entrypoints: dict[str, Callable[..., nn.Module]] = {}
_entrypoint_module: dict[str, str] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register `fn` under its function name; `fn(num_classes, in_chans, **kwargs)` builds the model."""
    name = fn.__name__
    if name in _entrypoints:
        raise ValueError(f"register_model: {name!r} is already registered (by {_entrypoint_module[name]})")
    _entrypoints[name] = fn
    _entrypoint_module[name] = fn.__module__.rpartition(".")[2]
    return fn


def list_models(pattern: str = "*", module: str | None = None) -> list[str]:
    """Sorted registered names matching the shell-style `pattern`, optionally only those of one family
    file (`module`, e.g. "cifar_resnet", "cifar_vgg", "external"). timm models are not listed: any
    `timm:<name>` that timm knows is accepted by `create_model`."""
    return sorted(
        name
        for name in _entrypoints
        if fnmatch.fnmatchcase(name, pattern) and (module is None or _entrypoint_module[name] == module)
    )


# constructor arguments of timm/torchvision that name weights to load (a file, a download): refused by create_model
WEIGHT_SOURCES = frozenset({"pretrained", "weights", "checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay",
                            "cache_dir", "weights_backbone"})


def create_model(
    name: str, num_classes: int = 10, input_size: int = 32, in_chans: int = 3, **kwargs
) -> nn.Module:
    """Build a freshly initialised model (never downloads weights).

    Args:
        name: a registered name (see `list_models()`) or `timm:<timm model name>`.
        num_classes: classifier outputs.
        input_size: input resolution (pixels, square) the model is meant for. Recorded in
            `model.compress_arch` for profiling/export; the registered CNNs accept any size (the
            CIFAR nets are built for 32, torchvision ImageNet nets for 224). timm models that need a
            size at construction (e.g. ViTs) take it as `img_size=` in kwargs.
        in_chans: input channels.
        kwargs: passed to the model's entry point (e.g. `conv_layer=`, `norm_layer=` for our CIFAR
            nets, torchvision or timm constructor arguments). Keep them JSON-compatible for models
            that are saved with `compress.save`.

    Returns:
        The model, with `model.compress_arch = {"name": name, "kwargs": {...}}` such that
        `create_model(name, **model.compress_arch["kwargs"])` rebuilds the same architecture.
    """
    if not isinstance(name, str):
        raise ValueError(f"create_model: the model name must be a string, got {name!r}")
    sources = sorted(set(kwargs) & WEIGHT_SOURCES)
    if sources:
        raise ValueError(
            f"create_model: {sources} would make the constructor read weights; create_model builds random weights "
            "and never reads a file or the network (compact files and checkpoints carry their own weights): drop "
            "them, and load a state dict into the built model instead"
        )
    if name.startswith(TIMM_PREFIX):
        from .external import create_timm_model

        model = create_timm_model(
            name[len(TIMM_PREFIX) :], num_classes=num_classes, in_chans=in_chans, **kwargs
        )
    elif name in _entrypoints:
        model = _entrypoints[name](num_classes=num_classes, in_chans=in_chans, **kwargs)
    else:
        raise ValueError(
            f"create_model: unknown model {name!r}. Known models: {', '.join(list_models())}; "
            f"any timm model is accepted as '{TIMM_PREFIX}<name>' (e.g. '{TIMM_PREFIX}resnet18')."
        )
    model.compress_arch = {
        "name": name,
        "kwargs": {"num_classes": num_classes, "input_size": input_size, "in_chans": in_chans, **kwargs},
    }
    return model
