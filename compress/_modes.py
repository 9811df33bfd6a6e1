"""Running a model in eval mode for a moment without losing its modules' own train/eval settings."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode inside the block; afterwards every module is back in its own mode (``model.train(flag)``
    would also switch a BatchNorm the user froze with ``.eval()`` back to training)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training
