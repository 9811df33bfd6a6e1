"""Gradient helpers shared by the kernel tests."""

import torch


def penalty_grads(conv, x, w, b):
    """Gradients in x, w and b (None where unused) of a gradient penalty, sum(d<y, g>/dx ** 2) + sum(d<y, g>/dw **
    2) with a fixed random g: double backward through y = `conv(x, w, b)`."""
    x, w, b = (t.detach().requires_grad_(True) for t in (x, w, b))
    y = conv(x, w, b)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(y)
    gx, gw = torch.autograd.grad(y, (x, w), g, create_graph=True)
    return torch.autograd.grad(gx.square().sum() + gw.square().sum(), (x, w, b), allow_unused=True)
