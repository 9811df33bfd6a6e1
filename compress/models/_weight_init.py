"""Weight initialisation shared by the CIFAR model families."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["init_weights"]


def init_weights(model: nn.Module) -> None:
    """Kaiming-normal (fan_out, ReLU) conv weights and zero conv biases; BatchNorm/GroupNorm weight 1, bias 0.

    Linear layers keep PyTorch's default init. Extra conv parameters (e.g. a filter skeleton) are left alone.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
            if module.affine:
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
