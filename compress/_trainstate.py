"""Training checkpoints: atomic writes, RNG state capture/restore, weights_only-safe contents.

A checkpoint is a dict of tensors and plain Python values (no pickled classes), so it loads with
`torch.load(path, weights_only=True)`, plus the SHA-256 of the rest under "sha256", checked on load.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import torch

from compress._digest import digest
from compress._files import atomic_write

__all__ = ["atomic_save", "load_checkpoint", "rng_state", "set_rng_state"]

DIGEST_KEY = "sha256"


def atomic_save(obj: dict, path: str | os.PathLike) -> Path:
    """torch.save `obj`, with the SHA-256 of its contents under "sha256" (`load_checkpoint` checks it), to `path`
    atomically (`compress._files.atomic_write`)."""
    data = {**obj, DIGEST_KEY: digest(obj)}
    return atomic_write(path, lambda tmp: torch.save(data, tmp))


RESUME_HINT = ("resume=true continues the run directory given by hydra.run.dir=<run dir> (which must contain "
               "checkpoints/last.pt; resume=auto starts a fresh run there when it does not), or pass "
               "resume=<path to a .pt>")


def load_checkpoint(path: str | os.PathLike, hint: str = RESUME_HINT, keys: tuple[str, ...] = ("model", "config")) -> dict:
    """A train.py checkpoint read on CPU with weights_only=True (no pickled code runs), which must hold `keys`.

    A missing, unreadable (truncated, not a torch file) or foreign file (pickled objects such as a whole model,
    or a dict without `keys`) raises an error naming the file and, for a missing one, `hint`."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a checkpoint; {hint}")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; {hint}")
    if _is_safetensors(path):
        raise ValueError(
            f"{path} is a safetensors file (a compact model written by export.py or compress.save?), not a train.py "
            "checkpoint; fine-tune a compact model with train.py init=<file>, and load it with compress.load"
        )
    try:
        with open(path, "rb") as f:  # a file object: torch.load picks its safetensors reader by a path's suffix
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"{path} is not a train.py checkpoint: torch.load(weights_only=True) refused it. Either it is another "
            "kind of file, or it holds pickled Python objects (a whole model saved with torch.save(model)), which "
            "are never loaded here because loading them can run code; save model.state_dict() instead"
        ) from None
    except Exception as err:  # a damaged archive or pickle surfaces as almost any error type inside torch.load
        first = str(err).splitlines()[0] if str(err) else ""
        first = f"{type(err).__name__}: {first}" if first else type(err).__name__
        raise ValueError(
            f"{path} cannot be read as a torch checkpoint ({first}); it is truncated or corrupt, or not a .pt "
            "file: take another checkpoint (checkpoints/best.pt, or an earlier copy)"
        ) from None
    if isinstance(ckpt, dict) and DIGEST_KEY in ckpt:  # checkpoints written before it have none
        if ckpt.pop(DIGEST_KEY) != digest(ckpt):
            raise ValueError(
                f"{path} is corrupt: its contents do not match the SHA-256 saved with them; take another "
                "checkpoint (checkpoints/best.pt, or an earlier copy)"
            )
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        found = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(
            f"{path} is not a train.py checkpoint (it has no {missing}; found {found}); give a "
            "checkpoints/last.pt or best.pt of a train.py run"
        )
    return ckpt


def _is_safetensors(path: Path) -> bool:
    """Whether the file starts as safetensors files do: an 8-byte little-endian header size, then a JSON header."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size


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
