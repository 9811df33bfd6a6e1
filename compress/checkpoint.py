"""Compact model files: `save(model, path)` / `load(path)`, one safetensors file, no pickled code.

The file holds the model's state_dict (parameters and persistent buffers, e.g. StripeConv2d's
`out_index`/`offset`) and, in its metadata under "compress.recipe", a JSON recipe:

    {"format": "compress.compact", "version": 1,
     "arch": {"name": "resnet56", "kwargs": {...}},          # model.compress_arch (create_model)
     "replacements": [{"name": "layer1.0.conv1", "type": "StripeConv2d", "config": {...}}, ...],
     "removed": ["layer3.8.conv2", ...],
     "buffer_dtypes": {"layer2.0.conv1.aa.filt": "bfloat16"}}   # only where a module keeps float buffers out of
                                                               # its state dict (persistent=False)

Loading rebuilds `create_model(arch)`, replaces the listed modules (parents before children) with
types from an allowlist table of type keys, deletes removed modules, and loads the tensors with
`load_state_dict(strict=True)`. Module types outside the table cannot be saved or loaded; custom
modules join with `register_module_type(key, cls)` and implement `config()` (docs/INTERFACES.md).
The metadata key "compress.sha256" holds a SHA-256 of the tensors and "compress.recipe_sha256" one of the recipe
text, both checked by `load` (against corruption, not tampering; files written before them have none and load
unchecked). `load` builds the recipe's model on the meta device first and compares its state_dict with the file's
tensors (names, shapes, kinds), so a recipe naming huge layers fails before anything is allocated; floating-point
tensors must be float16/bfloat16/float32/float64.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save as safetensors_bytes
from torch.nn.utils import parametrize

from compress._checks import check_module, check_real, listed, non_finite, refuse_wrapper, same_definition
from compress._digest import digest
from compress._files import atomic_write, read_safetensors
from compress._modes import rng_kept
from compress.surgery import conv_config, get_module, reparametrizations, replace_module

__all__ = ["save", "load", "rebuild", "rebuild_for", "register_module_type", "build_recipe", "FORMAT", "VERSION"]

FORMAT = "compress.compact"
VERSION = 1
_META_KEY = "compress.recipe"
_DIGEST_KEY = "compress.sha256"  # of the tensors (`compress._digest`): load detects a corrupted file
_RECIPE_DIGEST_KEY = "compress.recipe_sha256"  # of the recipe's JSON text
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _bn_config(m: nn.BatchNorm2d) -> dict:
    return {
        "num_features": m.num_features,
        "eps": m.eps,
        "momentum": m.momentum,
        "affine": m.affine,
        "track_running_stats": m.track_running_stats,
    }


def _linear_config(m: nn.Linear) -> dict:
    return {"in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None}


def _no_config(m: nn.Module) -> dict:
    return {}


def _bn_act_config(m: nn.Module) -> dict:
    """timm's BatchNormAct2d (BN then drop then act): the BN's config and its activation's type key and config."""
    if not isinstance(m.drop, nn.Identity):
        raise ValueError(f"compress.save: a BatchNormAct2d with a drop layer ({type(m.drop).__name__}) is not "
                         "supported in compact files")
    key = _type_key(m.act)
    if key is None:
        raise ValueError(f"compress.save: the activation {type(m.act).__name__} of a BatchNormAct2d is not an "
                         f"allowed type ({', '.join(sorted(_TYPES))})")
    return {**_bn_config(m), "act": {"type": key, "config": _config(m.act, key)}}


def _build_bn_act(config: dict, where: str) -> nn.Module:
    from timm.layers import BatchNormAct2d

    bn = BatchNormAct2d(**{k: v for k, v in config.items() if k != "act"}, apply_act=False)
    bn.act = _build(config["act"]["type"], config["act"]["config"], f"{where} (its activation)")
    return bn


def _own_config(m: nn.Module) -> dict:
    return m.config()


# The allowlist: type key -> ("module:attribute" or class, config function). Strings are imported on
# first use so that compress modules still being written never break `import compress.checkpoint`.
_TYPES: dict[str, tuple[str | type, Callable[[nn.Module], dict]]] = {
    "Conv2d": (nn.Conv2d, conv_config),
    "BatchNorm2d": (nn.BatchNorm2d, _bn_config),
    "SyncBatchNorm": (nn.SyncBatchNorm, _bn_config),  # a DDP model's BN, where compaction keeps it (fold_bn=false)
    # torchvision's BN with fixed statistics (detection backbones), where compaction keeps it (fold_bn=false)
    "FrozenBatchNorm2d": ("torchvision.ops:FrozenBatchNorm2d",
                          lambda m: {"num_features": m.running_mean.numel(), "eps": m.eps}),
    "Linear": (nn.Linear, _linear_config),
    "Identity": (nn.Identity, _no_config),
    "ReLU": (nn.ReLU, lambda m: {"inplace": m.inplace}),
    # the activations of timm's BatchNormAct2d, which stand in its place once BN folding takes the BN part
    "ReLU6": (nn.ReLU6, lambda m: {"inplace": m.inplace}),
    "SiLU": (nn.SiLU, lambda m: {"inplace": m.inplace}),
    "Hardswish": (nn.Hardswish, lambda m: {"inplace": m.inplace}),
    "GELU": (nn.GELU, lambda m: {"approximate": m.approximate}),
    "LeakyReLU": (nn.LeakyReLU, lambda m: {"negative_slope": m.negative_slope, "inplace": m.inplace}),  # CSP/Darknet
    "ELU": (nn.ELU, lambda m: {"alpha": m.alpha, "inplace": m.inplace}),
    "Mish": (nn.Mish, lambda m: {"inplace": m.inplace}),
    "Hardsigmoid": (nn.Hardsigmoid, lambda m: {"inplace": m.inplace}),
    "Sigmoid": (nn.Sigmoid, _no_config),
    "Tanh": (nn.Tanh, _no_config),
    "Sequential": (nn.Sequential, _no_config),
    "SkeletonConv2d": ("compress.skeleton:SkeletonConv2d",
                       lambda m: {**conv_config(m), "stripe_group": m.stripe_group}),
    "StripeConv2d": ("compress.stripe:StripeConv2d", _own_config),
    "Conv2dReLU": ("compress.stripe:Conv2dReLU", conv_config),
    "PiXBlock": ("compress.pix:PiXBlock", _own_config),
    # timm's TF-"same"-padding conv (tf_* models), which takes a bias when BN folds into it
    "Conv2dSame": ("timm.layers:Conv2dSame", lambda m: {k: v for k, v in conv_config(m).items() if k != "padding_mode"}),
    # timm's BN + activation (RegNet, EfficientNet, ...), which compaction shrinks with dead filters when BN is kept
    "BatchNormAct2d": ("timm.layers:BatchNormAct2d", _bn_act_config),
    # timm's nn.Linear (a classifier that reset_classifier() makes, e.g. MobileNetV3's)
    "timm.Linear": ("timm.layers:Linear", _linear_config),
    "ResidualReLU": ("compress.pix:ResidualReLU", _no_config),
    "ZeroChannels": ("compress.compaction:ZeroChannels", _own_config),
    "MaxPool2d": ("compress.pooling:MaxPool2d", _own_config),  # compaction's (fuse_relu) fast CPU max-pool
}


def register_module_type(key: str, cls: type[nn.Module], config: Callable[[nn.Module], dict] | None = None) -> None:
    """Allow `cls` in compact model files under type key `key`.

    `config(module) -> dict` must return JSON-serialisable kwargs with which `cls(**kwargs)` builds
    an empty module of the same shapes; by default the module's own `config()` method is used. The same class
    defined again (a notebook cell run twice, a reloaded module: same module and qualified name) replaces its earlier
    self, as `register_model` does; another class under a taken key is an error.
    """
    old = _resolve(key) if key in _TYPES else None
    if old is not None and not same_definition(old, cls):
        raise ValueError(f"register_module_type: key {key!r} is already taken by {old.__module__}.{old.__qualname__}; "
                         f"register {cls.__module__}.{cls.__qualname__} under another key")
    _TYPES[key] = (cls, config or _own_config)


# keys whose modules are not built as cls(**config): key -> builder(config, where)
_BUILDERS: dict[str, Callable[[dict, str], nn.Module]] = {"BatchNormAct2d": _build_bn_act}


def _resolve(key: str, imported_only: bool = False) -> type[nn.Module] | None:
    """The class of type key `key`; with `imported_only`, None where its module is not imported yet (then no
    instance of it can exist: `_type_key` need not import timm for a model that has none of its modules)."""
    cls, _ = _TYPES[key]
    if isinstance(cls, str):
        module, _, attr = cls.partition(":")
        if imported_only and module not in sys.modules:
            return None
        cls = getattr(importlib.import_module(module), attr)
    return cls


def _type_key(module: nn.Module) -> str | None:
    """The registered key of the module's type: the class itself, or one of the same module and qualified name (a
    module built before its class's cell ran again, `register_module_type`)."""
    for key in list(_TYPES):  # (a copy: another thread may register a type meanwhile)
        cls = _resolve(key, imported_only=True)
        if cls is not None and same_definition(type(module), cls):
            return key
    return None


def _config(module: nn.Module, key: str) -> dict:
    """The module's config normalised through JSON (tuples become lists), so configs compare equal."""
    return json.loads(json.dumps(_TYPES[key][1](module)))


def _build(key: str, config: dict, where: str) -> nn.Module:
    if key not in _TYPES:
        raise ValueError(
            f"{where}: unknown module type key {key!r} (allowed: {', '.join(sorted(_TYPES))}); if it is "
            "your own module, call compress.checkpoint.register_module_type(key, cls) before loading"
        )
    try:
        return _BUILDERS[key](config, where) if key in _BUILDERS else _resolve(key)(**config)
    except (TypeError, ValueError, RuntimeError) as err:  # RuntimeError: e.g. a negative size reaching torch.zeros
        raise ValueError(f"{where}: cannot build {key} from config {config}: {err}") from None


def _recorded_class(module: nn.Module):
    """What `_same` compares of a module's class: a class may stand for its base in the recipe (`recipe_base`, e.g.
    PiXBottleneck: the same modules and state as torchvision's Bottleneck, another forward; `load` gives it back
    its class); a parametrised module (weight_norm), whose class torch makes anew at each call, is its class before
    that with the types of its parametrisations."""
    if parametrize.is_parametrized(module):
        kinds = sorted((name, tuple(type(p).__qualname__ for p in plist)) for name, plist in module.parametrizations.items())
        return parametrize.type_before_parametrizations(module), tuple(kinds)
    return getattr(type(module), "recipe_base", type(module))


def _removal_hint(model: nn.Module, ref: nn.Module) -> str:
    """Where the first module of `model` that computes its weight from other tensors in a way the architecture's
    does not (torch's pruning, weight or spectral norm, a parametrization: a save refuses it) says how to make it
    plain, that advice ('' where none does)."""
    for name, module in model.named_modules():
        calls = reparametrizations(module)
        try:
            built = reparametrizations(get_module(ref, name))
        except AttributeError:
            built = []
        if calls and calls != built:
            return (f". Module {name or '(the model)'!r} computes its weight from other tensors (torch's pruning, "
                    f"weight or spectral norm, or a parametrization); make it plain first: {'; '.join(calls)}")
    return ""


def _same(model_mod: nn.Module, ref_mod: nn.Module | None) -> bool:
    if ref_mod is None or _recorded_class(model_mod) != _recorded_class(ref_mod):
        return False
    key = _type_key(model_mod)
    if key is None:  # no config(): its settings as printed (a pool's size, a Linear's features, a dropout's p)
        return model_mod.extra_repr() == ref_mod.extra_repr()
    return _config(model_mod, key) == _config(ref_mod, key)


_PLAIN = (bool, int, float, str, type(None))


def _plain_settings(module: nn.Module) -> dict[str, str]:
    """{name: repr} of `module`'s own public attributes holding plain values (bool, int, float, str, None, or tuples
    and lists of them): settings a forward may read (``if self.use_aux:``) that neither the state dict nor, for a
    user's module, the printed settings hold. ``training`` is left out (load returns eval mode)."""
    def plain(v):
        return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(plain(e) for e in v))

    return {k: repr(v) for k, v in vars(module).items() if not k.startswith("_") and k != "training" and plain(v)}


def _changed_settings(model: nn.Module, ref: nn.Module) -> list[str]:
    """'module.attr = value (rebuilt: value)' for each plain attribute (`_plain_settings`) of a module of `model`
    whose value differs from, or is missing in, the same module of the rebuilt reference `ref` (same class)."""
    changed = []
    ref_modules = dict(ref.named_modules())
    for name, module in model.named_modules():
        ref_mod = ref_modules.get(name)
        if ref_mod is None or type(ref_mod) is not type(module):
            continue
        mine, theirs = _plain_settings(module), _plain_settings(ref_mod)
        changed += [f"{name + '.' if name else ''}{k} = {v} (rebuilt: {theirs.get(k, 'absent')})"
                    for k, v in mine.items() if theirs.get(k) != v]
    return changed


def _shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{state_dict key: (shape, floating point?)}: what a recipe must rebuild. The precision is not part of it:
    `load` assigns the saved tensors, so a float16/bfloat16 model comes back in its own dtypes."""
    return {k: (tuple(v.shape), v.is_floating_point()) for k, v in model.state_dict().items()}


def _apply(model: nn.Module, replacements: list[dict], removed: list[str], where: str) -> None:
    """Apply recipe entries to `model` in place (parents listed before their children)."""
    for entry in replacements:
        name, key, config = entry["name"], entry["type"], entry["config"]
        new = _build(key, config, f"{where}: module {name!r}")
        parent, _, child = name.rpartition(".")
        try:
            owner = get_module(model, parent)
        except AttributeError:
            raise ValueError(f"{where}: module {name!r} has no parent {parent!r} in the rebuilt model") from None
        taken = hasattr(owner, child) and not isinstance(getattr(owner, child), nn.Module)
        if not (child.isidentifier() or child.isdigit()) or child.startswith("__") or taken:
            raise ValueError(f"{where}: {name!r} cannot name a module (an attribute of its parent that is not a "
                             "module, or not a module name)")
        if isinstance(getattr(owner, child, None), nn.Module):
            replace_module(model, name, new)  # under its other names too (self.norm = self.bn), as compaction did
        else:
            setattr(owner, child, new)
    for name in removed:
        parent, _, child = name.rpartition(".")
        try:
            owner = get_module(model, parent)
        except AttributeError:
            owner = None
        if owner is None or child not in owner._modules:
            raise ValueError(f"{where}: removed module {name!r} is not a module of the rebuilt model")
        delattr(owner, child)


def _reference(arch: dict, where: str) -> nn.Module:
    from compress.models import create_model

    missing_module = unregistered_module(arch)
    if missing_module is not None:
        raise ValueError(f"{where}: {missing_module}")
    try:
        return create_model(arch["name"], **arch["kwargs"])
    except (TypeError, ValueError, RuntimeError) as err:  # RuntimeError: sizes no tensor can have (negative, huge)
        raise ValueError(f"{where}: cannot rebuild the architecture {arch}: {err}") from None


def unregistered_module(arch: dict, imports: list[str] = ()) -> str | None:
    """What to import for an `arch` (a `compress_arch`) whose builder is not registered in this process: the module
    it records (your own model's), else the `imports` its run used; None when it is registered (or timm's), or when
    nothing says where it comes from (create_model's own error lists the known models). Loading never imports code
    a file names, so this only says what to import."""
    from compress.models._registry import TIMM_PREFIX, registering_module

    name, module = arch.get("name"), arch.get("module")
    if not isinstance(name, str) or name.startswith(TIMM_PREFIX) or registering_module(name) is not None:
        return None
    if module == "__main__":
        return (f"the model {name!r} was registered by a script (__main__), so no other process can build it; move its "
                "@compress.register_model builder into a module, import that module, and save the model again")
    if isinstance(module, str):
        return (f"the model {name!r} is built by module {module!r}, which this process has not imported (nothing "
                f"imports code a file names); import it first: `import {module}`, or train.py / export.py "
                f"imports=[{module}]")
    if imports:
        return (f"the model {name!r} is not registered in this process; its run imported {list(imports)}: pass "
                f"imports=[{','.join(imports)}] (nothing imports code a file names)")
    return None


def _arch(model: nn.Module) -> dict:
    arch = getattr(model, "compress_arch", None)
    if not isinstance(arch, dict) or "name" not in arch or "kwargs" not in arch:
        raise ValueError(
            "compress.save: the model has no compress_arch {'name', 'kwargs'}; build it with "
            "compress.create_model(...) (compaction keeps the attribute) so that load can rebuild it"
        )
    try:
        return json.loads(json.dumps(arch))
    except TypeError as err:
        raise ValueError(f"compress.save: model.compress_arch is not JSON-serialisable ({err}); pass only "
                         "JSON values (numbers, strings, lists, dicts) as create_model kwargs") from None


def build_recipe(model: nn.Module) -> dict:
    """The JSON recipe that rebuilds `model`'s structure from `create_model(**model.compress_arch)`.

    Raises ValueError when a changed module's type is not in the allowlist, or when the rebuilt
    structure would not match the model's state_dict (names, shapes, floating point or integer).
    """
    refuse_wrapper("compress.save", model, "save")
    arch = _arch(model)
    if arch.get("module") == "__main__":
        warnings.warn(f"compress.save: the model {arch['name']!r} was registered by a script (__main__); only a process "
                      "that registers it again can load the file: move its @compress.register_model builder into a "
                      "module", stacklevel=3)
    # the reference is compared, never run: built on the meta device it takes no memory; a constructor that reads
    # tensor values builds it for real, raising the real errors. Its numbers are never used: the user's random
    # stream is put back (a constructor may draw on an explicit CPU device even then)
    with rng_kept():
        ref = None
        try:
            with torch.device("meta"):
                ref, replacements, removed = _matched_reference(model, arch)
        except Exception:  # noqa: BLE001 - the real build below raises the errors that concern the user
            pass
        if ref is None or _names_meta(ref):  # (a constructor that kept its device: compared as built for real)
            ref, replacements, removed = _matched_reference(model, arch)
    changed = _changed_settings(model, ref)
    if changed:
        warnings.warn(f"compress.save: attributes set after construction are not saved: {listed(changed)}; load gives "
                      "the constructor's values. If they change the forward, make them arguments of the model's "
                      "builder (create_model kwargs) and save again", stacklevel=3)
    if _shapes(ref) != _shapes(model):
        diff = sorted(set(_shapes(ref).items()) ^ set(_shapes(model).items()))[:5]
        raise ValueError(
            f"compress.save: the recipe would not rebuild this model (state_dict entries differ: {diff}); "
            "a module changed in a way its config() does not describe" + _removal_hint(model, ref)
        )
    recipe = {"format": FORMAT, "version": VERSION, "arch": arch, "replacements": replacements, "removed": removed}
    unsaved = {key: str(buf.dtype).removeprefix("torch.") for key, _, _, buf in _unsaved_float_buffers(model)}
    if unsaved:  # buffers kept out of the state dict (timm's BlurPool2d filter): the file keeps their dtypes
        recipe["buffer_dtypes"] = unsaved
    compaction = getattr(model, "compress_compaction", None)
    if isinstance(compaction, dict):  # how compress.compact made it (threshold, BN folding, MAC budget): kept as is
        recipe["compaction"] = json.loads(json.dumps(compaction))
    # the state_dict names that are one tensor (the file holds a copy per name); always written, so that load and
    # rebuild give the model exactly these ties, also where compaction untied ones its constructor makes
    recipe["tied"] = tied_groups(model)
    return recipe


def _matched_reference(model: nn.Module, arch: dict) -> tuple[nn.Module, list[dict], list[str]]:
    """The architecture's model rebuilt and changed to match `model`'s modules, with the recipe entries that did it
    (replacements, removed names); ValueError naming a changed module of a type outside the allowlist."""
    replacements = []
    ref = _reference(arch, "compress.save")
    for name, module in model.named_modules():
        if not name:
            continue
        try:
            ref_mod = get_module(ref, name)
        except AttributeError:
            ref_mod = None
        if _same(module, ref_mod):
            continue
        key = _type_key(module)
        if key is None:
            raise ValueError(
                f"compress.save: module {name!r} of type {type(module).__name__} differs from the rebuilt "
                f"architecture and is not an allowed type ({', '.join(sorted(_TYPES))}); register it with "
                "compress.checkpoint.register_module_type(key, cls) and give it a config() method"
                + _removal_hint(model, ref)
            )
        entry = {"name": name, "type": key, "config": _config(module, key)}
        _apply(ref, [entry], [], "compress.save")
        replacements.append(entry)
    model_names = {n for n, _ in model.named_modules(remove_duplicate=False)}  # (a module aliased later: not removed)
    removed = [n for n, _ in ref.named_modules() if n and n not in model_names]
    removed = [n for n in removed if n.rpartition(".")[0] not in removed]  # deleting a parent is enough
    _apply(ref, [], removed, "compress.save")
    return ref, replacements, removed


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The state_dict names that hold one and the same parameter or buffer (weights tied in a model's __init__ or
    later, or a module registered under two names), as lists of two or more names."""
    keys = model.state_dict().keys()
    by_tensor: dict[int, list[str]] = {}
    for name, t in _named_tensors(model).items():
        if name in keys:
            by_tensor.setdefault(id(t), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it has (shared ones and aliased modules included)."""
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    (module._parameters if leaf in module._parameters else module._buffers)[leaf] = value


def _check_groups(model: nn.Module, groups, where: str) -> list[list[str]]:
    """`groups` (a recipe's "tied") if it is a list of lists of two or more state_dict names of the model, each
    group of one shape; ValueError naming `where` otherwise."""
    tensors = model.state_dict()
    ok = isinstance(groups, list) and all(
        isinstance(g, list) and len(g) > 1 and all(isinstance(n, str) and n in tensors for n in g)
        and len({tuple(tensors[n].shape) for n in g}) == 1 for g in groups)
    if not ok:
        raise ValueError(f"{where}: the recipe is incomplete or malformed (tied is {groups!r:.200})")
    return groups


def _copies_agree(names: list[str], tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `tensors` holds the same bits under each of `names` (copies of one tensor: NaN included, which
    torch.equal tells apart)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    first = tensors[names[0]]
    return all(tensors[n].shape == first.shape and tensors[n].dtype == first.dtype
               and torch.equal(bits(tensors[n]), bits(first)) for n in names[1:])


def _set_ties(model: nn.Module, groups: list[list[str]]) -> None:
    """In place: the model's state_dict tensors are shared exactly as `groups` (`tied_groups`) says: one the
    architecture's constructor shares is copied for each further name, then each group's names take one tensor
    (a parameter where the group has one: a buffer registered as a parameter's alias stays that)."""
    keys = model.state_dict().keys()
    seen: set[int] = set()
    for name, t in _named_tensors(model).items():
        if name not in keys:  # (non-persistent buffers: not in files, shared as the constructor made them)
            continue
        if id(t) in seen:
            _set_tensor(model, name, nn.Parameter(t.detach().clone(), t.requires_grad)
                        if isinstance(t, nn.Parameter) else t.clone())
        seen.add(id(t))
    _tie_groups(model, groups)


def _tie_groups(model: nn.Module, groups: list[list[str]]) -> None:
    tensors = _named_tensors(model)
    for names in groups:
        source = next((tensors[n] for n in names if isinstance(tensors[n], nn.Parameter)), tensors[names[0]])
        for name in names:
            _set_tensor(model, name, source)


def _tie_loaded(model: nn.Module, groups: list[list[str]], tensors: dict[str, torch.Tensor], where: str) -> None:
    """In place, after ``load_state_dict(assign=True)`` (which gives every name its own tensor): each group's names
    hold one tensor again; ValueError where the file's copies of one differ (an edited file)."""
    for names in groups:
        if not _copies_agree(names, tensors):
            raise ValueError(f"{where}: the tensors {', '.join(names)} are one tensor in the model but differ in "
                             "the file (edited?); export it again with compress.save")
    _tie_groups(model, groups)


def save(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write `model` (recipe + state_dict) to one safetensors file at `path` (a leading ~ is the home folder, as
    on the command line: taken literally, the missing folders created for it made a folder named '~'), atomically.
    Forward hooks are not saved (a warning names the modules that have them)."""
    if isinstance(path, nn.Module):
        raise TypeError("compress.save: the arguments are swapped; call compress.save(model, path)")
    check_module("compress.save", model)
    check_real("compress.save", model)
    given, path = path, _home_expanded(path, "compress.save")
    if str(given).endswith(("/", os.sep)) or path.is_dir():
        raise ValueError(f"compress.save: {given} is a directory; give a file path, e.g. {path / 'model.safetensors'}")
    from compress.stripe import StripeConv2d

    for name, module in model.named_modules():
        if isinstance(module, StripeConv2d) and module.num_stripes:
            try:
                module.check_indices()
            except ValueError as err:
                raise ValueError(f"compress.save: layer {name}: {err}") from None
    recipe = build_recipe(model)
    tensors = {k: _narrowest(v.detach().to("cpu")).clone().contiguous() for k, v in model.state_dict().items()}
    _check_dtypes(tensors, "compress.save", "convert those to a float dtype first (e.g. model.float())")
    hooked = [n or "(the model)" for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        warnings.warn(f"compress.save: forward hooks are not saved (on {', '.join(hooked[:5])}"
                      + (", ..." if len(hooked) > 5 else "") + "); the loaded model runs without them", stacklevel=2)
    text = json.dumps(recipe)
    metadata = {_META_KEY: text, _RECIPE_DIGEST_KEY: hashlib.sha256(text.encode()).hexdigest(), _DIGEST_KEY: digest(tensors)}
    # the file's bytes are made in memory and written to atomic_write's temporary file: safetensors' save_file
    # writes its own randomly named temporary file first, which a killed process left behind in the user's folder
    return atomic_write(path, lambda tmp: _write_safetensors(tmp, tensors, metadata))


def _home_expanded(path: str | os.PathLike, where: str) -> Path:
    """`path` with a leading ~ or ~user expanded; ValueError naming it for a ~user that does not exist."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory."
        raise ValueError(f"{where}: {path}: no home folder for its '~' (no such user); give the full path") from None


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """safetensors' file of `tensors` and `metadata` at `path`, its header's metadata keys in sorted order: the same
    model saved twice gives the same bytes (safetensors 0.8 writes the metadata keys in a random, hash-map order, so
    a file's SHA-256 changed from save to save; the tensors' entries it orders itself, by offset)."""
    raw = memoryview(safetensors_bytes(tensors, metadata=metadata))
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(bytes(raw[8:8 + size]))
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # (safetensors pads the header to 8 bytes with spaces)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.write(raw[8 + size:])


def _check_dtypes(tensors: dict[str, torch.Tensor], where: str, fix: str) -> None:
    """ValueError unless every floating-point tensor is float16/bfloat16/float32/float64 and none is complex (no
    module here computes in float8 or complex). Mixed float dtypes are allowed (a float16 classifier)."""
    odd = [f"{k} ({t.dtype})" for k, t in tensors.items()
           if t.is_complex() or (t.is_floating_point() and t.dtype not in _FLOAT_DTYPES)]
    if odd:
        raise ValueError(f"{where}: tensors of unsupported dtypes: {', '.join(odd[:5])}; {fix}")


def parse_recipe(text: str, where: str) -> dict:
    """The recipe JSON `text` as a dict; ValueError naming `where` for text that is not JSON (or too deep, or a
    number too long for Python to read)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where}: corrupt recipe ({type(err).__name__}: {str(err)[:200]})") from None


_INT_WIDTHS = (torch.int8, torch.int16, torch.int32, torch.int64)


def _narrowest(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor in the narrowest signed type that holds its values (stripe indices in int16 instead of
    int64: a quarter of their bytes in the file; `load` casts them back to the module's type); others as they are."""
    if t.is_floating_point() or t.dtype not in _INT_WIDTHS or t.numel() == 0:
        return t
    lo, hi = int(t.min()), int(t.max())
    for dtype in _INT_WIDTHS:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return t.to(dtype)
    return t


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if path.is_dir():
        raise ValueError(f"compress.load: {path} is a directory; give the compact model file in it (export.py writes "
                         "model.compact.safetensors)")
    if not path.is_file():
        if os.path.lexists(path):  # a FIFO, a device, a symlink loop or one to nothing
            raise ValueError(f"compress.load: {path} is not a regular file; give the compact model file "
                             "(model.compact.safetensors)")
        raise FileNotFoundError(f"compress.load: no compact model file at {path}")
    try:
        metadata, tensors = read_safetensors(path)
    except Exception as err:  # safetensors raises its own error types for bad headers and short files
        with open(path, "rb") as f:
            head = f.read(9)
        if head[:4] == b"PK\x03\x04":  # a zip archive: what torch.save writes
            from compress._trainstate import load_checkpoint

            try:
                load_checkpoint(path)  # weights_only: no pickled code runs
            except (ValueError, OSError) as why:  # a state dict of torch.save, another zip, a damaged file
                raise ValueError(
                    f"compress.load: {path} is a zip archive but no compact model file (a safetensors file written "
                    f"by export.py or compress.save), nor a train.py checkpoint that export.py would take ({why})"
                ) from None
            raise ValueError(
                f"compress.load: {path} is a train.py checkpoint (.pt), not a compact model file; it becomes one "
                f"with: python export.py ckpt={path}"
            ) from None
        if len(head) == 9 and head[8:] != b"{":  # a safetensors file: 8 bytes of header length, then its JSON
            raise ValueError(
                f"compress.load: {path} is not a safetensors file (its first bytes are no safetensors header: a file "
                "of another kind, such as ONNX, JSON or a pickle, or a corrupt one); give the compact model file, "
                "model.compact.safetensors in export.py's out directory, or export it again"
            ) from None
        raise ValueError(
            f"compress.load: {path} is not a readable safetensors file ({err}); it is truncated or "
            "corrupt: export it again with compress.save or export.py"
        ) from None
    if _META_KEY not in metadata:
        raise ValueError(f"compress.load: {path} has no compact-model recipe (metadata key {_META_KEY!r}); "
                         "it was not written by compress.save")
    text = metadata[_META_KEY]
    if _RECIPE_DIGEST_KEY in metadata and metadata[_RECIPE_DIGEST_KEY] != hashlib.sha256(text.encode()).hexdigest():
        raise ValueError(f"compress.load: {path} is corrupt: its recipe does not match the SHA-256 saved with it; "
                         "export it again with compress.save or export.py")
    recipe = parse_recipe(text, f"compress.load: {path}")
    if not isinstance(recipe, dict) or recipe.get("format") != FORMAT:
        raise ValueError(f"compress.load: {path} has no {FORMAT!r} recipe")
    if recipe.get("version") != VERSION:
        raise ValueError(
            f"compress.load: {path} is format version {recipe.get('version')!r}; this code reads version "
            f"{VERSION!r}: upgrade compress or re-export the model"
        )
    if _DIGEST_KEY in metadata and metadata[_DIGEST_KEY] != digest(tensors):  # files before it have none
        raise ValueError(
            f"compress.load: {path} is corrupt: its tensors do not match the SHA-256 saved with them; export it "
            "again with compress.save or export.py"
        )
    return recipe, tensors


def rebuild(recipe: dict, where: str = "compress.rebuild") -> nn.Module:
    """The module structure a recipe (`build_recipe`) describes, with fresh weights (drawn from the global random
    stream, as `create_model`'s): the architecture rebuilt, the replacements (allowlisted types only) and removals
    applied, its tensors shared as the recipe's "tied" record says; `compress_arch` and `compress_compaction` set."""
    try:
        arch, replacements, removed = recipe["arch"], recipe["replacements"], recipe["removed"]
        model = _reference(arch, where)
        _apply(model, replacements, removed, where)
        from compress.pix import use_pix_bottlenecks  # here: compress.pix imports the model zoo

        use_pix_bottlenecks(model)
    except (KeyError, TypeError, AttributeError) as err:  # a missing entry, or a value of the wrong type
        raise ValueError(f"{where}: the recipe is incomplete or malformed ({err!r})") from None
    if "tied" in recipe:
        _set_ties(model, _check_groups(model, recipe["tied"], where))
    model.compress_arch = copy.deepcopy(arch)
    if isinstance(recipe.get("compaction"), dict):
        model.compress_compaction = recipe["compaction"]
    return model


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model saved by `save` at `path` (a leading ~ is the home folder) on `device`, in eval mode.

    Raises ValueError naming the file and the problem for a truncated or tampered file (bad header,
    missing or extra tensors, shape mismatch, unknown module type).
    """
    if isinstance(device, torch.dtype) or not isinstance(device, (str, torch.device, int)):
        raise ValueError(f"compress.load: device must be a device ('cpu', 'cuda:0', a torch.device), got {device!r}"
                         + ("; to change the dtype, call .to(dtype) on the loaded model"
                            if isinstance(device, torch.dtype) else ""))
    path = _home_expanded(path, "compress.load")
    recipe, tensors = _read(path)
    where = f"compress.load({path})"
    _check_dtypes(tensors, where, "export it again with compress.save or export.py")
    try:  # the fit check's meta-device model takes the file's tensors: no memory or random numbers for replaced weights
        model = _assigned(rebuild_for(recipe, tensors, where, meta=True), tensors, where)
    except ValueError:  # (a file that does not fit: the real build below raises the error again)
        model = None
    if model is None or _holds_meta(model):  # a module with tensors outside its state dict, or one that copies into
        model = _assigned(rebuild_for(recipe, tensors, where), tensors, where)  # its own on load: built for real
    _cast_unsaved_buffers(model, recipe.get("buffer_dtypes"), {t.dtype for t in tensors.values() if t.is_floating_point()},
                          where)
    infinite = non_finite(tensors)
    if infinite:
        warnings.warn(f"{where}: tensors hold NaN or inf values: {listed(infinite)}", stacklevel=2)
    return model.to(device).eval()


def _holds_meta(model: nn.Module) -> bool:
    """Whether any parameter, buffer or tensor attribute of `model` is on the meta device, or a module names that
    device in an attribute (`_names_meta`)."""
    return _names_meta(model) or any(t.is_meta for m in model.modules()
                                     for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values())
                                     if isinstance(t, torch.Tensor))


def _names_meta(model: nn.Module) -> bool:
    """Whether a module of `model` keeps the meta device in a plain attribute (a constructor that records
    ``self.device_type = self.conv.weight.device.type``, read by its forward's ``torch.autocast(self.device_type)``):
    built on the meta device, such a model differs from one built for real beyond its tensors."""
    return any(isinstance(v, torch.device) and v.type == "meta" or isinstance(v, str) and v == "meta"
               for m in model.modules() for v in vars(m).values())


def _assigned(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> nn.Module:
    """`model` holding the file's `tensors` (``load_state_dict(assign=True)``: no copy), ties as the recipe says."""
    tied = tied_groups(model)  # (the recipe's record, or for an older file what `rebuild_for` kept)
    own = model.state_dict()
    for key, t in tensors.items():  # integers were saved narrow (`_narrowest`): back to the module's type
        if key in own and not t.is_floating_point() and not own[key].is_floating_point() and t.dtype != own[key].dtype:
            tensors[key] = t.to(own[key].dtype)
    tensors = OrderedDict(tensors)
    tensors._metadata = own._metadata  # each module's state version, which some loaders read (torchvision's MNASNet)
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except (RuntimeError, ValueError, TypeError) as err:  # ValueError/TypeError: indices StripeConv2d rejects
        detail = " ".join(str(err).split())
        raise ValueError(f"{where}: the tensors do not fit the recipe's model: {detail}") from None
    _tie_loaded(model, tied, tensors, where)
    return model


_FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _cast_unsaved_buffers(model: nn.Module, recorded: dict | None, file_dtypes: set[torch.dtype], where: str) -> None:
    """In place: the float buffers a module keeps out of its state dict (``persistent=False``, e.g. timm's
    BlurPool2d filter), which the file does not hold and the rebuilt model made in float32, take the dtypes the
    recipe recorded (`recorded`, `build_recipe`'s ``buffer_dtypes``); for a file written before that record, the
    file's float dtype where it has one. (A bf16 model loaded with a float32 filter failed in its first forward.)"""
    if recorded is not None and not isinstance(recorded, dict):
        raise ValueError(f"{where}: the recipe is incomplete or malformed (buffer_dtypes is {recorded!r})")
    for key, module, name, buf in list(_unsaved_float_buffers(model)):
        if recorded is not None:
            if recorded.get(key, "float32") not in _FLOATS:
                raise ValueError(f"{where}: the recipe gives buffer {key} the dtype {recorded[key]!r}, not a float "
                                 "dtype (a tampered file?)")
            dtype = _FLOATS[recorded.get(key, "float32")]
        elif len(file_dtypes) == 1:
            (dtype,) = file_dtypes
        else:
            continue
        module._buffers[name] = buf.to(dtype)


def _unsaved_float_buffers(model: nn.Module):
    """(state-dict-style key, module, buffer name, buffer) of each float buffer a module keeps out of its state dict
    (``persistent=False``)."""
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None and buf.is_floating_point():
                yield f"{module_name}.{name}".lstrip("."), module, name, buf


def rebuild_for(recipe: dict | str, tensors: dict[str, torch.Tensor], where: str, meta: bool = False) -> nn.Module:
    """`rebuild(recipe)` (a dict, or its JSON text) once the recipe's state_dict is known to fit `tensors` (the
    weights it is built for; see `_check_fit`). With `meta`, the meta-device model of that check where it could be
    built (no memory, no random numbers: for ``load_state_dict(..., assign=True)``, after which the caller checks
    that no meta tensor is left)."""
    if isinstance(recipe, str):
        recipe = parse_recipe(recipe, where)
    model = _check_fit(recipe, tensors, where)
    if model is None or not meta:
        with rng_kept():  # (the weights are overwritten by `tensors`: no numbers drawn from the user's stream)
            model = rebuild(recipe, where)
    if "tied" not in recipe:  # written before the record: the constructor's ties whose copies in `tensors` are equal
        _set_ties(model, [g for g in tied_groups(model) if all(n in tensors for n in g) and _copies_agree(g, tensors)])
    return model


def _check_fit(recipe: dict, tensors: dict[str, torch.Tensor], where: str) -> nn.Module | None:
    """The recipe's model built on the meta device (no memory, whatever sizes the recipe names); ValueError unless
    its state_dict has the file's tensor names, shapes and kinds (floating point or not). A model that cannot be
    built on the meta device, for whatever reason, is left to the real build (None), which runs the same `rebuild`
    and raises its errors (an unregistered model, bad arguments): e.g. torchvision's RegNet, whose __init__ reads
    tensor values (``tolist()``), which meta tensors do not have."""
    try:
        with rng_kept(), torch.device("meta"):  # (a constructor may draw on an explicit CPU device even then)
            meta = rebuild(recipe, where)
    except Exception:  # noqa: BLE001 - load_state_dict checks the weights then
        return None
    want, have = _shapes(meta), {k: (tuple(t.shape), t.is_floating_point()) for k, t in tensors.items()}
    if want != have:
        missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
        differ = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
        parts = [f"{label} {', '.join(keys[:5])}" + (", ..." if len(keys) > 5 else "")
                 for label, keys in (("missing", missing), ("unexpected", extra), ("shape or kind differs for", differ))
                 if keys]
        raise ValueError(f"{where}: the tensors do not fit the recipe's model: {'; '.join(parts)}")
    return meta
