"""Model registry: entry points registered by name, and the one public constructor `create_model`."""

from __future__ import annotations

import fnmatch
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch.nn as nn

from compress._checks import positive_int, same_definition

__all__ = ["register_model", "list_models", "create_model", "import_modules", "module_names"]

TIMM_PREFIX = "timm:"

_entrypoints: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register `fn` under its function name; `fn(num_classes=..., in_chans=..., **model_kwargs)` builds the model
    (train.py's model_kwargs: +model.kwargs.<name>; name them in fn's signature, as a `**kwargs` there would take a
    misspelt one without a word).

    Your own architecture: decorate its builder in an importable module (`my_nets.py`), import that module before
    `create_model` / `compress.load` (train.py and export.py: `imports=[my_nets]`). The same definition run again
    (a notebook cell, a reloaded module) replaces its earlier self; another function of a registered name is an
    error."""
    name = fn.__name__
    old = _entrypoints.get(name)
    if old is not None and not same_definition(old, fn):
        raise ValueError(f"register_model: {name!r} is already registered (by {old.__module__}); give yours another "
                         "name")
    _entrypoints[name] = fn
    return fn


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def module_names(value) -> list[str]:
    """`imports=` as a list of module names: one name (a string) or a list of them; ValueError for anything else,
    a file path included (with the module name to give instead)."""
    if value is None or isinstance(value, str):
        names = [] if value is None else [value]
    elif isinstance(value, Iterable) and not isinstance(value, Mapping):  # (a dict would pass as its keys)
        names = list(value)
    else:
        raise ValueError(f"imports: {value!r} is not a module name or a list of them (imports=[my_nets])")
    for name in names:
        if not isinstance(name, str) or not _MODULE_NAME.fullmatch(name) or name.endswith(".py"):
            hint = ""
            if isinstance(name, str) and ("/" in name or name.endswith(".py")):
                path = Path(name).with_suffix("")
                dotted = ".".join(path.parts) if not path.is_absolute() and ".." not in path.parts else None
                if dotted is None:
                    hint = " (a file path? give its module name, and add its folder to PYTHONPATH)"
                elif _MODULE_NAME.fullmatch(dotted):
                    hint = f" (a file path? give its module name, e.g. imports=[{dotted}], run where it is)"
                else:
                    hint = (" (a file path? it cannot be imported as a module: its folder and file names must be Python "
                            "names, letters, digits and _; rename them, then give its module name)")
            raise ValueError(f"imports: {name!r} is not a Python module name{hint}")
    return [str(name) for name in names]


def import_modules(value, search_dir: str | Path) -> list[str]:
    """Import the Python modules `value` names (`module_names`: `my_nets`, `[my_nets, pkg.nets]`) so that the models
    their `@register_model` builders define can be built; `search_dir` (the directory the command was started in)
    is searched first. Returns the names. Raises ValueError for a name that is not a module name or not found;
    an error inside a module propagates, with a note naming it."""
    names = module_names(value)
    search_dir = str(Path(search_dir).resolve())
    if sys.path[:1] != [search_dir]:  # first, also when it is on sys.path already (after site-packages, say)
        sys.path[:] = [search_dir] + [p for p in sys.path if p != search_dir]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:
            missing = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
            if missing is not None and (name == missing or name.startswith(missing + ".")):  # not the module's imports
                raise ValueError(f"imports: no module named {name!r} in {search_dir}, on PYTHONPATH or installed; run "
                                 "the command where the module is, or add its folder to PYTHONPATH") from None
            # (err.add_note on Python 3.11+, which prints the notes with the traceback; the attribute on 3.10 too)
            err.__notes__ = [*getattr(err, "__notes__", []), f"(raised while importing {name!r}, named in imports=)"]
            raise
    return names


def _unknown_model(name: str) -> str:
    return (f"create_model: unknown model {name!r}. Known models: {', '.join(list_models())}; any timm model is "
            f"accepted as '{TIMM_PREFIX}<name>' (e.g. '{TIMM_PREFIX}resnet18'). Your own model: register its builder "
            "with @compress.register_model in a module and import that module first (train.py and export.py: "
            "imports=[module])")


def registering_module(name: str) -> str | None:
    """The module whose `@register_model` defined `name` (full dotted name), None for timm or unknown names."""
    fn = _entrypoints.get(name)
    return fn.__module__ if fn is not None else None


def list_models(pattern: str = "*", module: str | None = None) -> list[str]:
    """Sorted registered names matching the shell-style `pattern`, optionally only those of one family
    file (`module`, e.g. "cifar_resnet", "cifar_vgg", "external", or your module's dotted name). timm models are
    not listed: any `timm:<name>` that timm knows is accepted by `create_model`."""

    def comes_from(fn) -> bool:  # the module's last name ("cifar_vgg") or its whole dotted name ("pkg.nets")
        return module in (fn.__module__, fn.__module__.rpartition(".")[2])

    if module is not None and not any(comes_from(fn) for fn in _entrypoints.values()):
        families = sorted({fn.__module__.rpartition(".")[2] for fn in _entrypoints.values()})
        raise ValueError(f"list_models: no registered model comes from module {module!r}; the families are "
                         f"{families}")
    return sorted(name for name, fn in _entrypoints.items()
                  if fnmatch.fnmatchcase(name, pattern) and (module is None or comes_from(fn)))


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
            CIFAR nets are built for 32, torchvision ImageNet nets for 224), except torchvision's vgg*_bn,
            whose five 2x2 max-pools need at least 32 px. timm models that need a
            size at construction (e.g. ViTs) take it as `img_size=` in kwargs; a registered builder
            with an `input_size` parameter of its own is given it.
        in_chans: input channels.
        kwargs: passed to the model's entry point (e.g. `conv_layer=`, `norm_layer=` for our CIFAR
            nets, torchvision or timm constructor arguments). Keep them JSON-compatible for models
            that are saved with `compress.save`.

    Returns:
        The model, with `model.compress_arch = {"name": name, "kwargs": {...}}` such that
        `create_model(name, **model.compress_arch["kwargs"])` rebuilds the same architecture; for a model
        registered outside compress, also "module": the module that registers it (a hint for loading elsewhere:
        nothing ever imports it on its own).
    """
    if not isinstance(name, str):
        raise ValueError(f"create_model: the model name must be a string, got {name!r}")
    # (timm reads num_classes=0 as "no classifier": build such a feature extractor with timm itself)
    num_classes, input_size, in_chans = (positive_int("create_model", key, value) for key, value in
                                         (("num_classes", num_classes), ("input_size", input_size), ("in_chans", in_chans)))
    sources = sorted(set(kwargs) & WEIGHT_SOURCES)
    if sources:
        raise ValueError(
            f"create_model: {sources} would make the constructor read weights; create_model builds random weights "
            "and never reads a file or the network (compact files and checkpoints carry their own weights): drop "
            "them, and load a local state dict file into the built model instead (train.py model.weights=<file>; "
            "Python: compress.models.load_weights(model, file))"
        )
    if name.startswith(TIMM_PREFIX):
        from .external import create_timm_model

        model = create_timm_model(
            name[len(TIMM_PREFIX) :], num_classes=num_classes, in_chans=in_chans, **kwargs
        )
    elif name in _entrypoints:
        builder = _entrypoints[name]
        # a builder that names input_size among its parameters is built for it (it was only recorded)
        sized = {"input_size": input_size} if "input_size" in inspect.signature(builder).parameters else {}
        model = builder(num_classes=num_classes, in_chans=in_chans, **sized, **kwargs)
        if not isinstance(model, nn.Module):
            raise ValueError(f"create_model: the builder {_entrypoints[name].__module__}.{name} returned a "
                             f"{type(model).__name__}, not a torch.nn.Module; return the model it builds")
    else:
        raise ValueError(_unknown_model(name))
    model.compress_arch = {
        "name": name,
        "kwargs": {"num_classes": num_classes, "input_size": input_size, "in_chans": in_chans, **kwargs},
    }
    module = registering_module(name)
    if module is not None and not module.startswith("compress."):  # your own model: where to find its builder
        model.compress_arch["module"] = module
    return model
