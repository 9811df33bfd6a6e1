"""Training checkpoints: atomic writes, RNG state capture/restore, weights_only-safe contents.

A checkpoint is a dict of tensors and plain Python values (no pickled classes), so it loads with
`torch.load(path, weights_only=True)`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

__all__ = ["atomic_save", "load_checkpoint", "rng_state", "set_rng_state"]


def atomic_save(obj: dict, path: str | os.PathLike) -> Path:
    """torch.save `obj` to a temporary file next to `path`, then os.replace it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a training checkpoint on CPU with weights_only=True; a missing file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}; resume=true continues the run directory given by "
            f"hydra.run.dir=<run dir> (which must contain checkpoints/last.pt), or pass resume=<path to a .pt>"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def rng_state(generator: torch.Generator | None = None) -> dict:
    """RNG states of torch (CPU and CUDA), Python `random`, NumPy and an optional data generator."""
    py_version, py_ints, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": py_version, "state": torch.tensor(py_ints, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "data": generator.get_state() if generator is not None else None,
    }


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    """Restore what `rng_state` captured (CUDA states only when CUDA is available)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if generator is not None and state["data"] is not None:
        generator.set_state(state["data"])
