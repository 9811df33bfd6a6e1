"""SHA-256 of a checkpoint's contents, so that loading detects a corrupted file (torch.load and safetensors check
nothing): compact model files keep it in their metadata, train.py checkpoints under the key "sha256"."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["digest"]


def digest(obj: object) -> str:
    """Hex SHA-256 of `obj`: nested dicts (in key order), lists and tuples of tensors (dtype, shape and bytes, taken on
    the CPU) and plain values (their repr). ValueError for a sparse or meta tensor (it has no plain bytes)."""
    h = hashlib.sha256()
    _update(h, obj)
    return h.hexdigest()


def _update(h, obj: object) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_meta:
            raise ValueError(f"a {'meta' if obj.is_meta else obj.layout} tensor, which no checkpoint of ours holds")
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.view(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for key in sorted(obj, key=repr):
            h.update(f"{key!r}=".encode())
            _update(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}:".encode())
        for item in obj:
            _update(h, item)
    else:
        h.update(f"V{obj!r};".encode())
