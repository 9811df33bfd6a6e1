"""PiXBottleneck: torchvision's ResNet Bottleneck with a PiX block for its squeeze conv (see `compress.pix`).

In a module of its own so that `import compress` does not import torchvision (seconds: its ops import
torch._dynamo); `compress.pix.PiXBottleneck` names it and `compress.pix.use_pix_bottlenecks` imports it on use.
"""

from __future__ import annotations

import torch
import torchvision.models as tvm

__all__ = ["PiXBottleneck"]


class PiXBottleneck(tvm.resnet.Bottleneck):
    """torchvision's Bottleneck after `insert_pix` (same state dict; conv1 is the PiXBlock, bn1 an Identity, and
    the tail a `ResidualReLU` module). Its forward is torchvision's without the ReLU after PiX (a no-op there: see
    `_squeeze_with_pix`) and with the residual sum + ReLU as `kernels.residual_relu`, which on CUDA also pools the
    block output for the next block's PiX in the same pass (H200: benchmarks/results/pix_gpu_h200.json,
    pix_profile_h200_b64.txt)."""

    recipe_base = tvm.resnet.Bottleneck  # compress.save records the base type; compress.load restores this one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn2(self.conv2(self.conv1(x))))
        out = self.bn3(self.conv3(out))
        return self.residual(out, x if self.downsample is None else self.downsample(x))
