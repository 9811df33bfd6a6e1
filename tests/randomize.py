"""Random BatchNorm state for tests (tests only): folding, compaction and export are checked on models whose BN
layers do something, not on the identity that fresh BN layers are in eval mode."""

from __future__ import annotations

import torch
import torch.nn as nn


def random_bn_(model: nn.Module, gen: torch.Generator, kinds: tuple[type, ...] = (nn.BatchNorm2d,)) -> nn.Module:
    """Give every module of `kinds` in `model` random statistics and affine terms, in place, from `gen`: running
    mean U(-0.5, 0.5), running variance U(0.5, 1.5), weight U(0.5, 1.5), bias U(-0.2, 0.2). Returns `model`."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, kinds):
                for t, low, width in ((m.running_mean, -0.5, 1.0), (m.running_var, 0.5, 1.0), (m.weight, 0.5, 1.0),
                                      (m.bias, -0.2, 0.4)):
                    t.copy_(torch.rand(t.shape, generator=gen, dtype=t.dtype) * width + low)
    return model
