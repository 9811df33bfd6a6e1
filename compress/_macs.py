"""A quick MACs estimate for training logs (to be replaced by compress.profile).

Counts Conv2d and Linear layers with forward hooks on one input; a skeleton conv's pruned MACs are
its dense MACs times the fraction of stripes kept. Dead filters are not propagated to the next layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from compress.skeleton import SkeletonConv2d

__all__ = ["estimate_macs"]


@torch.no_grad()
def estimate_macs(model: nn.Module, input_shape: tuple[int, int, int], threshold: float) -> tuple[int, int]:
    """(dense MACs, pruned MACs estimate) for one input of shape (C, H, W), batch 1."""
    totals = [0, 0.0]

    def hook(module: nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            dense = out.numel() * (module.in_channels // module.groups) * module.kernel_size[0] * module.kernel_size[1]
        else:
            dense = out.numel() * module.in_features
        kept = 1.0
        if isinstance(module, SkeletonConv2d):
            kept = float(module.stripe_mask(threshold).float().mean())
        totals[0] += dense
        totals[1] += dense * kept

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    param = next(model.parameters())
    was_training = model.training
    try:
        model.eval()
        model(torch.zeros(1, *input_shape, device=param.device, dtype=param.dtype))  # no RNG use
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return int(totals[0]), int(round(totals[1]))
