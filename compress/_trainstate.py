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

__all__ = ["atomic_save", "check_weight_kinds", "load_checkpoint", "rng_state", "set_rng_state"]

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
        with open(path, "rb") as f:
            head = f.read(4)
        if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch.save's zip archive, a pickle
            what = f"it starts with {head!r}" if head else "it is empty"
            raise ValueError(f"{path} is not a torch checkpoint ({what}; torch.save writes a zip archive): give a "
                             "checkpoints/last.pt or best.pt of a train.py run") from None
        first = str(err).splitlines()[0] if str(err) else ""
        first = f"{type(err).__name__}: {first}" if first else type(err).__name__
        raise ValueError(
            f"{path} cannot be read as a torch checkpoint ({first}); it is truncated or corrupt, or not a .pt "
            "file: take another checkpoint (checkpoints/best.pt, or an earlier copy)"
        ) from None
    if isinstance(ckpt, dict) and DIGEST_KEY in ckpt:  # checkpoints written before it have none
        try:
            contents = digest({k: v for k, v in ckpt.items() if k != DIGEST_KEY})
        except ValueError as err:
            raise ValueError(f"{path} holds {err}: it is not a train.py checkpoint; take another checkpoint "
                             "(checkpoints/best.pt, or an earlier copy)") from None
        if ckpt.pop(DIGEST_KEY) != contents:
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
    wrong = _wrong_types(ckpt)
    if wrong:
        raise ValueError(f"{path} is corrupt or edited ({'; '.join(wrong)}): not what train.py writes; take another "
                         "checkpoint (checkpoints/best.pt, or an earlier copy)")
    return ckpt


CONFIG_GROUPS = ("model", "data", "prune", "optim", "trainer", "pix")


def _wrong_types(ckpt: dict) -> list[str]:
    """The parts of a checkpoint that its readers take apart and that do not have the types train.py writes: "model"
    a dict of named tensors, "config" a dict whose groups (and model.kwargs) are dicts, "arch" a dict with a str name
    and dict kwargs."""
    wrong = []
    model, config, arch = ckpt.get("model", {}), ckpt.get("config", {}), ckpt.get("arch")
    if not (isinstance(model, dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())):
        wrong.append("'model' is not a dict of named tensors")
    if not isinstance(config, dict):
        wrong.append(f"'config' is a {type(config).__name__}")
    else:
        wrong += [f"config.{g} is a {type(config[g]).__name__}" for g in CONFIG_GROUPS
                  if g in config and not isinstance(config[g], dict)]
        model_cfg = config.get("model")
        kwargs = model_cfg.get("kwargs") if isinstance(model_cfg, dict) else None
        if kwargs is not None and not isinstance(kwargs, dict):
            wrong.append(f"config.model.kwargs is a {type(kwargs).__name__}")
    if arch is not None and not (isinstance(arch, dict) and isinstance(arch.get("name"), str)
                                 and isinstance(arch.get("kwargs"), dict)):
        wrong.append("'arch' is not a dict with a str 'name' and a dict 'kwargs'")
    return wrong


def check_weight_kinds(model: torch.nn.Module, weights: dict, where: str) -> None:
    """ValueError unless each tensor of `weights` is of the kind (floating point or not) of the model's state_dict
    entry of its name, and none is complex: load_state_dict would copy int values into float weights (or drop a
    complex one's imaginary part) without a word."""
    own = model.state_dict()
    odd = [f"{k} ({t.dtype}; the model's is {own[k].dtype})" for k, t in weights.items()
           if k in own and (t.is_complex() or t.is_floating_point() != own[k].is_floating_point())]
    if odd:
        raise ValueError(f"{where}: tensors of the wrong kind: {', '.join(odd[:5])}; the file is corrupt or edited: "
                         "take another checkpoint")


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
