"""The MACs estimate in the training logs: compress.profile's count, with each skeleton conv's
MACs scaled by its fraction of stripes kept (dead filters are not propagated to the next layer)."""

from __future__ import annotations

import torch.nn as nn

from compress.profile import profile
from compress.skeleton import SkeletonConv2d

__all__ = ["estimate_macs"]


def estimate_macs(model: nn.Module, input_shape: tuple[int, int, int], threshold: float) -> tuple[int, int]:
    """(dense MACs, pruned MACs estimate) for one input of shape (C, H, W)."""
    report = profile(model, input_size=input_shape, latency=False)
    kept = {
        name: float(m.stripe_mask(threshold).float().mean())
        for name, m in model.named_modules()
        if isinstance(m, SkeletonConv2d)
    }
    pruned = sum(layer.macs * kept.get(layer.name, 1.0) for layer in report.layers)
    return report.macs, int(round(pruned))
