"""Argument checks shared by the library's entry points."""

from __future__ import annotations

import inspect
import numbers
import os
from collections.abc import Sequence

import torch.nn as nn


def positive_int(where: str, key: str, value: int) -> int:
    """value as a Python int (numpy ints too: they would reach a saved config), else a ValueError naming where."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    return int(value)


def chw(where: str, input_size) -> tuple[int, int, int]:
    """`input_size` (C, H, W) as three positive ints, else a ValueError naming `where` (a string '332' passed as a
    sequence of three, and a 0 or negative size failed inside ATen)."""
    def whole_size(v) -> bool:  # an int, or a float holding one (32.0 from a config)
        return (not isinstance(v, bool) and isinstance(v, numbers.Real) and v >= 1
                and (isinstance(v, numbers.Integral) or float(v).is_integer()))

    if (isinstance(input_size, (str, bytes)) or not isinstance(input_size, Sequence) or len(input_size) != 3
            or not all(whole_size(v) for v in input_size)):
        raise ValueError(f"{where}: input_size is (C, H, W), three positive ints, got {input_size!r}")
    return tuple(int(v) for v in input_size)


def same_definition(a, b) -> bool:
    """Whether two classes or functions are one definition: the same object, or the same module and qualified name
    (a notebook cell run again, a reloaded module, which make a new object of it)."""
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def check_module(where: str, model) -> None:
    """A TypeError naming `where` unless `model` is an nn.Module (a path, None or a state dict failed later with an
    AttributeError such as "'str' object has no attribute 'named_modules'")."""
    if not isinstance(model, nn.Module):
        hint = ("; to read a model file, use compress.load(path)" if isinstance(model, (str, os.PathLike))
                else "; build the model and load_state_dict into it" if isinstance(model, dict) else "")
        shown = (f"{type(model).__name__} {model!r:.80}" if model is None or isinstance(model, (str, os.PathLike, numbers.Number))
                 else f"an object of type {type(model).__name__}")
        raise TypeError(f"{where}: expected a model (an nn.Module), got {shown}{hint}")


def check_one_input(where: str, model: nn.Module) -> None:
    """ValueError naming `where` when `model`'s forward needs more than one argument: `where` runs it on one
    (B, C, H, W) batch (a ``forward(x, y)`` failed there with a raw TypeError about a missing argument)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # (a forward inspect cannot read: its call says what it lacks)
        return
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(required) > 1:
        raise ValueError(f"{where}: the model's forward takes {len(required)} inputs ({', '.join(required)}) and "
                         f"{where.split(':')[0]} runs it on one (B, C, H, W) batch; wrap the model in a module whose "
                         "forward takes that batch alone and supplies the others")


def check_real(where: str, model: nn.Module, other_fix: str = "") -> None:
    """ValueError naming `where` and the first such tensor when `model` holds meta-device tensors (built under
    ``torch.device("meta")``): they have shapes but no values, which `where` reads (a raw "Tensor.item() cannot be
    called on meta tensors" or "Cannot copy out of meta tensor" before). `other_fix`: a remedy named first."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.is_meta:
            raise ValueError(f"{where}: the model's tensors are on the meta device ({name}, ...): they hold shapes but "
                             f"no values; {other_fix + ', or ' if other_fix else ''}give them values first: "
                             "model.to_empty(device='cpu') then model.load_state_dict(state), or "
                             "model.load_state_dict(state, assign=True)")


def refuse_wrapper(where: str, model: nn.Module, verb: str) -> None:
    """A ValueError naming the inner model where a torch.compile, DataParallel, DDP or CUDAGraphModel wrapper was
    given (their module tree is the wrapper's, not the model's: compaction could not trace it, and a file would not
    rebuild it); `check_module` first."""
    from compress.graphs import CUDAGraphModel

    check_module(where, model)

    if hasattr(model, "_orig_mod"):
        inner = "model._orig_mod (the module torch.compile wraps)"
    elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        inner = "model.module"
    elif isinstance(model, CUDAGraphModel):
        inner = "model.model"
    else:
        return
    raise ValueError(f"{where}: {type(model).__name__} is a wrapper; {verb} the model inside it: {inner}")


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside torch.compile, DataParallel and DDP wrappers (any nesting), which share its parameters."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def non_finite(tensors) -> list[str]:
    """Names of the floating-point tensors of `tensors` ({name: tensor}) that hold NaN or inf values."""
    return [k for k, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]


def listed(names: list[str], most: int = 5) -> str:
    """'a, b, c' of the first `most` names, with ', ...' when there are more."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")
