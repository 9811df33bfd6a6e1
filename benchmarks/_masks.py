"""Stripe masks for the benchmark scripts (compact_cpu.py, stripe_models_gpu.py).

- `swp_like`: a model with Filter Skeletons and random SWP-like masks (a share of dead filters per layer,
  the alive filters keeping a share of their stripes), dead filters' BN zeroed as `swp_update` does.
- `masks_from_checkpoint` / `save_masks` / `load_masks` / `apply_masks`: the per-layer skeleton masks of a
  real `train.py` run (bool (out, kh, kw) per skeleton conv, by module name) in a small JSON file, and
  applied to a fresh model (random weights: the speed of a compact model depends on its masks only).

The JSON file: {"format": "compress-stripe-masks/1", "model", "model_kwargs", "threshold", "source",
"run": {...}, "summary": {...}, "layers": {name: {"shape": [N, kh, kw], "kept": int, "bits": hex}}}; "bits" is
the row-major (N, kh, kw) mask packed 8 entries per byte, most significant bit first (numpy.packbits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from compress.models import create_model
from compress.skeleton import SkeletonConv2d, attach_skeletons, swp_update
from compress.surgery import find_chains, trace

FORMAT = "compress-stripe-masks/1"

__all__ = ["FORMAT", "inner_convs", "swp_like", "calibrate_bn", "masks_from_checkpoint", "save_masks", "load_masks",
           "apply_masks", "skeleton_masks"]  # fmt: skip


def inner_convs(model: nn.Module) -> set[str]:
    """Convs whose dead filters compaction removes (torch.fx chain producers: VGG stacks, the inner convs
    of residual blocks), plus names ending in "conv1" or starting with "features" (the rule compact_cpu.py
    has always used: the same set on CIFAR ResNet-56 and VGG16, where it adds the stem conv1)."""
    graph = trace(model)
    chains = {c.producer for c in find_chains(model, graph)} if graph is not None else set()
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    return chains | {n for n in names if n.endswith("conv1") or n.startswith("features")}


def swp_like(name: str, seed: int, masks: Mapping[str, tuple[float, float]], stripe_group: int = 1,
             **model_kwargs) -> nn.Module:
    """`create_model(name, **model_kwargs)` (default num_classes=10, input_size=32) with skeletons masked at
    random (seeded): in the convs of `inner_convs` a share masks["inner"][0] of the filters is dead and the
    others keep each stripe with probability masks["inner"][1]; masks["outer"] likewise for the other
    skeleton convs. With `stripe_group` G > 1 the skeletons are grouped (one entry per G filters and offset), and
    the shares apply to groups. Dead filters' BN is zeroed (swp_update), the others' statistics calibrated
    (`calibrate_bn`). Returned in eval mode."""
    model_kwargs = {"num_classes": 10, "input_size": 32, **model_kwargs}
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = create_model(name, **model_kwargs)
    inner = inner_convs(model)
    attach_skeletons(model, stripe_group=stripe_group)
    with torch.no_grad():
        for conv_name, m in model.named_modules():
            if isinstance(m, SkeletonConv2d):
                dead, keep = masks["inner" if conv_name in inner else "outer"]
                fs = (torch.rand(m.skeleton.shape, generator=gen) < keep).float()
                rows = fs.shape[0]  # filters, or groups of filters
                fs[torch.randperm(rows, generator=gen)[: int(dead * rows)]] = 0
                m.skeleton.copy_(fs)
    swp_update(model, alpha=0.0, threshold=0.0)
    return calibrate_bn(model, model_kwargs["input_size"], seed)


def calibrate_bn(model: nn.Module, input_size: int, seed: int) -> nn.Module:
    """Set every BatchNorm's running statistics to those of one batch of 16 random images (a train-mode forward);
    returns `model` in eval mode. Random weights with most stripes masked otherwise shrink the activations layer
    by layer (BN's default statistics are mean 0, variance 1) until the logits hardly depend on the input (VGG16
    with its real masks: a spread of 4e-8 of their size), and a check of the compact model against the skeleton
    model could not see a wrong layer. Dead filters' BN (weight and bias 0) still outputs 0."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, that batch's statistics
    x = torch.randn(16, 3, input_size, input_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.train()(x)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return model.eval()


def skeleton_masks(model: nn.Module, threshold: float = 0.0) -> dict[str, torch.Tensor]:
    """{name: bool (N, kh, kw)} of every SkeletonConv2d of `model`: True where |skeleton| > threshold."""
    return {
        n: m.stripe_mask(threshold).cpu() for n, m in model.named_modules() if isinstance(m, SkeletonConv2d)
    }


def masks_from_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(masks, meta) of a train.py checkpoint, read with the export flow's loader (weights_only, nothing
    unpickled). The threshold is the one export.py uses: the run's prune.threshold for SWP runs, else 0."""
    from compress.export import load_training_checkpoint

    model, cfg = load_training_checkpoint(path)
    prune = cfg.get("prune") or {}
    threshold = float(prune.get("threshold", 0.0)) if prune.get("name") == "swp" else 0.0
    masks = skeleton_masks(model, threshold)
    if not masks:
        raise ValueError(f"{path}: the checkpoint has no Filter Skeletons (was it trained with prune=none?)")
    arch = model.compress_arch
    data = cfg.get("data") or {}
    run = {
        "data": data.get("name"),
        "prune": {k: prune.get(k) for k in ("name", "alpha", "threshold", "stripe_group") if k in prune},
        "epochs": (cfg.get("optim") or {}).get("epochs"),
        "seed": (cfg.get("trainer") or {}).get("seed"),
    }
    summary_file = Path(path).resolve().parent.parent / "summary.json"
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
        run.update({k: summary.get(k) for k in ("test_accuracy", "epochs", "steps")})
    # MACs of the trained model's own compaction: with the trained weights a dead filter's BN can hold a tiny
    # nonzero bias (SGD momentum after the last zeroing), which compaction keeps where the consumer pads;
    # apply_masks zeroes those exactly, so the same masks on a fresh model can give slightly fewer MACs
    from compress.compaction import compact
    from compress.profile import profile

    kw = arch["kwargs"]
    size = (int(kw.get("in_chans", 3)), int(kw.get("input_size", 32)), int(kw.get("input_size", 32)))
    run["trained_compact_macs"] = profile(
        compact(model, threshold=threshold, fold_bn=True), size, latency=False
    ).macs
    meta = {
        "model": arch["name"],
        "model_kwargs": dict(arch["kwargs"]),
        "threshold": threshold,
        "source": str(path),
        "run": run,
    }
    return masks, meta


def _summary(masks: Mapping[str, torch.Tensor]) -> dict:
    total = sum(m.numel() for m in masks.values())
    kept = sum(int(m.sum()) for m in masks.values())
    dead = sum(int((~m.flatten(1).any(1)).sum()) for m in masks.values())
    return {"layers": len(masks), "stripes_total": total, "stripes_kept": kept, "filters_dead": dead}


def save_masks(masks: Mapping[str, torch.Tensor], meta: dict, path: str | os.PathLike) -> Path:
    """Write `masks` ({name: bool (N, kh, kw)}) and `meta` as the JSON file described in the module
    docstring; returns the path."""
    layers = {}
    for name, m in masks.items():
        m = m.detach().cpu()
        if m.dtype != torch.bool or m.dim() != 3:
            raise ValueError(
                f"save_masks: mask of {name!r} must be bool (N, kh, kw), got {m.dtype} {tuple(m.shape)}"
            )
        bits = np.packbits(m.flatten().numpy().astype(np.uint8)).tobytes().hex()
        layers[name] = {"shape": list(m.shape), "kept": int(m.sum()), "bits": bits}
    head = json.dumps({"format": FORMAT, **meta, "summary": _summary(masks)}, indent=1)
    rows = ",\n".join(f"  {json.dumps(n)}: {json.dumps(v)}" for n, v in layers.items())  # one line a layer
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head[:-2] + f',\n "layers": {{\n{rows}\n }}\n}}\n')
    return path


def load_masks(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(masks, meta) from a file written by `save_masks`; checks the format and each layer's kept count."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(
            f"{path}: not a stripe mask file (format {doc.get('format')!r}, expected {FORMAT!r})"
        )
    masks = {}
    for name, layer in doc.pop("layers").items():
        shape = tuple(layer["shape"])
        n = int(np.prod(shape))
        flat = np.unpackbits(np.frombuffer(bytes.fromhex(layer["bits"]), dtype=np.uint8))[:n]
        if flat.size != n:
            raise ValueError(f"{path}: layer {name!r} has {flat.size} mask bits, expected {n}")
        mask = torch.from_numpy(flat.astype(bool)).view(shape)
        if int(mask.sum()) != layer["kept"]:
            raise ValueError(
                f"{path}: layer {name!r} keeps {int(mask.sum())} stripes, the file says {layer['kept']}"
            )
        masks[name] = mask
    return masks, doc


def apply_masks(model: nn.Module, masks: Mapping[str, torch.Tensor]) -> nn.Module:
    """Attach Filter Skeletons to exactly the convs named in `masks` and set them to the masks (1 kept,
    0 dropped), zeroing dead filters' BN as swp_update does; returns `model` in eval mode. A name or shape
    that does not fit the model is an error."""
    names = set(attach_skeletons(model, include=[glob_escape(n) for n in masks]))
    if names != set(masks):
        missing = sorted(set(masks) - names)
        raise ValueError(
            f"apply_masks: {len(missing)} masked layers are not eligible convs of "
            f"{type(model).__name__}: {missing[:5]}"
        )
    with torch.no_grad():
        for name in names:
            conv = model.get_submodule(name)
            if tuple(conv.skeleton.shape) != tuple(masks[name].shape):
                raise ValueError(
                    f"apply_masks: mask of {name!r} has shape {tuple(masks[name].shape)}, the "
                    f"skeleton {tuple(conv.skeleton.shape)}"
                )
            conv.skeleton.copy_(masks[name].to(conv.skeleton.dtype))
    swp_update(model, alpha=0.0, threshold=0.0)
    for name in names:
        model.get_submodule(name).skeleton.grad = None
    return model.eval()


def glob_escape(name: str) -> str:
    """`name` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
