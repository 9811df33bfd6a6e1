"""Triton GPU path of ``compress::stripe_conv2d`` (work in progress)."""

from __future__ import annotations


def available(x) -> bool:
    return False
