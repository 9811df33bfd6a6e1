"""Dense weights from a local file (a pretrained torchvision/timm state dict) loaded into a freshly built model, so
that SWP can start from them. Nothing is downloaded and nothing pickled is executed."""

from __future__ import annotations

import argparse
import os
import pickle
import re
from pathlib import Path

import torch
import torch.nn as nn

from compress._checks import listed, non_finite

__all__ = ["load_weights", "read_weights", "weights_problems"]

# dicts that wrap a state dict in common training scripts (timm's train.py, torchvision's references, Lightning)
_WRAPPERS = ("state_dict", "model", "model_state_dict", "state_dict_ema", "model_ema")
_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel / DataParallel, torch.compile


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in the file at `path` (see `load_weights`); ValueError naming the file and the fix for
    anything else."""
    from compress._files import read_safetensors
    from compress._trainstate import _is_safetensors
    from compress.checkpoint import _META_KEY

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model.weights: no file at {path}; give a local state dict file (.pth, .pt or "
                                ".safetensors; nothing is downloaded)")
    if _is_safetensors(path):
        try:
            metadata, state = read_safetensors(path)
            compact = _META_KEY in metadata
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for bad headers, short files
            raise ValueError(f"model.weights: {path} is a damaged .safetensors file ({' '.join(str(err).split())[:200]}"
                             "); it is truncated or was not fully written: copy or download it again") from None
        if compact:
            raise ValueError(f"model.weights: {path} is a compact model file (export.py / compress.save); "
                             f"fine-tune it with init={path} instead")
    else:
        state = _torch_file(path)
    # train.py's own checkpoints (another script's {"model", "optimizer", "config"} file is unwrapped below)
    if isinstance(state, dict) and {"config", "model", "optimizer", "scheduler", "rng", "best_accuracy"} <= state.keys():
        raise ValueError(f"model.weights: {path} is a train.py checkpoint; continue it with resume={path}, or export "
                         "it and fine-tune the compact model with init=<file>")
    while isinstance(state, dict) and not all(isinstance(v, torch.Tensor) for v in state.values()):
        inner = next((state[k] for k in _WRAPPERS if isinstance(state.get(k), dict) and _holds_tensors(state[k])), None)
        if inner is None:
            break
        state = inner
    if isinstance(state, dict):
        state.pop("n_averaged", None)  # torch.optim.swa_utils.AveragedModel's count of averaged models
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"model.weights: {path} holds no state dict (a dict of tensor names to tensors, possibly "
                         f"under one of the keys {', '.join(_WRAPPERS)})")
    stripped = True
    while stripped:  # in any order and nesting: torch.compile around DDP gives _orig_mod.module.
        stripped = False
        for prefix in _PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state, stripped = {k[len(prefix):]: v for k, v in state.items()}, True
    bad = non_finite(state)
    if bad:
        raise ValueError(f"model.weights: {path} holds NaN or inf values in {listed(bad)}; give a file of finite weights")
    return state


def _torch_file(path: Path):
    """The contents of a torch file, read with `weights_only=True` (argparse args, which training scripts save beside
    the weights, allowed); ValueError naming the file otherwise."""
    try:  # a file object: torch.load picks its safetensors reader by a path's suffix
        with open(path, "rb") as f, torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # "Unsupported global: GLOBAL x.y", "unsupported GLOBAL posix.system ..."
        found = re.search(r"GLOBAL ([\w.]+)", str(err), re.IGNORECASE)
        if found is None:
            raise ValueError(f"model.weights: {path} is not a torch file (a state dict saved with torch.save, or a "
                             ".safetensors file)") from None
        raise ValueError(f"model.weights: {path} holds Python objects besides tensors ({found.group(1)}), which are "
                         "never loaded because unpickling them can run code; save the state dict alone, e.g. "
                         "torch.save(model.state_dict(), 'weights.pth')") from None
    except Exception as err:  # a damaged archive surfaces as almost any error type inside torch.load
        raise ValueError(f"model.weights: {path} is not a torch file, or a damaged one ({type(err).__name__})") from None


def _holds_tensors(d: dict) -> bool:
    return any(isinstance(v, (torch.Tensor, dict)) for v in d.values())


def _classifier(model: nn.Module) -> str | None:
    """The name of the model's classifier module: timm's `get_classifier()`, else its last nn.Linear."""
    head = model.get_classifier() if callable(getattr(model, "get_classifier", None)) else None
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(head, nn.Module) and id(head) in names:
        return names[id(head)]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def weights_problems(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], str | None]:
    """(the classifier entries of `model` the state dict leaves as initialised, what keeps it from fitting `model`
    or None)."""
    own = model.state_dict()
    head = _classifier(model)
    fresh = sorted(k for k in own if head is not None and k.rpartition(".")[0] == head
                   and (k not in state or state[k].shape != own[k].shape))
    missing = [k for k in own if k not in state and k not in fresh and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} {tuple(state[k].shape)} (model: {tuple(own[k].shape)})"
                  for k in state if k in own and k not in fresh and state[k].shape != own[k].shape]
    parts = [f"{what}: {', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''} ({len(keys)})"
             for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", mismatched)) if keys]
    return fresh, "; ".join(parts) or None


@torch.no_grad()
def load_weights(model: nn.Module, path: str | os.PathLike, state: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Copy the tensors of the state dict file at `path` into `model` (as built by `create_model`), in place; return
    the classifier entries left as initialised because the file's differ in shape (another number of classes) or
    are absent (a headless file).

    The file: a torch file read with `weights_only=True` (a state dict, possibly inside a "state_dict"/"model"/...
    dict, keys possibly prefixed "module." or "_orig_mod.") or a safetensors file; finite values. Every other entry
    must match the model's names and shapes (num_batches_tracked may be absent); otherwise a ValueError lists what
    differs. `state`: the file's contents, read already (`read_weights`).
    """
    state = read_weights(path) if state is None else state
    fresh, problems = weights_problems(model, state)
    if problems:
        raise ValueError(f"model.weights: {path} does not fit {type(model).__name__}: {problems}. Give the state dict "
                         "of the same architecture (model=, model.kwargs, data.in_chans)")
    from compress.checkpoint import tied_groups  # (here: compress.checkpoint imports the model zoo)

    for names in tied_groups(model):  # one tensor in the model: the copy of the last name would win silently
        held = [n for n in names if n in state and n not in fresh]
        if any(not torch.equal(state[n], state[held[0]]) for n in held[1:]):
            raise ValueError(f"model.weights: {path} holds different values for {', '.join(held)}, which "
                             f"{type(model).__name__} ties into one tensor; give weights of a model with those tied")
    own = model.state_dict()
    for key, value in state.items():
        if key not in fresh:
            own[key].copy_(value)
    return fresh
