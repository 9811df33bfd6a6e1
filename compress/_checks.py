"""Argument checks shared by the library's entry points."""

from __future__ import annotations

import numbers

import torch.nn as nn


def positive_int(where: str, key: str, value: int) -> int:
    """value as a Python int (numpy ints too: they would reach a saved config), else a ValueError naming where."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    return int(value)


def refuse_wrapper(where: str, model: nn.Module, verb: str) -> None:
    """A ValueError naming the inner model where a torch.compile, DataParallel, DDP or CUDAGraphModel wrapper was
    given (their module tree is the wrapper's, not the model's: compaction could not trace it, and a file would not
    rebuild it)."""
    from compress.graphs import CUDAGraphModel

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
