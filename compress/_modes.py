"""State put back after a block: a model's train/eval settings (`evaluating`), the global random streams
(`rng_kept`); the lock the library's process-wide steps take turns under (`LIBRARY_LOCK`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

# Held by the calls that change process-wide state while they run: torch.fx tracing (surgery.trace, so compact and
# attach_skeletons) patches nn.Module.__call__ for the whole process, and profile switches the attention fast path
# off and hooks and re-modes the model. Such library calls from several threads take turns; forwards a user runs
# in other threads meanwhile are not covered (README, "Threads").
LIBRARY_LOCK = threading.RLock()


@contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    """`model` in training (`training`) or eval mode inside the block; afterwards every module is back in its own
    mode (``model.train(flag)`` would also switch a BatchNorm the user froze with ``.eval()`` back to training)."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield model
    finally:
        for m, was in modes:
            m.training = was


def evaluating(model: nn.Module):
    """`in_mode(model, False)`: `model` in eval mode inside the block, every module's own mode back after it."""
    return in_mode(model, False)


@contextmanager
def rng_kept(device: torch.device | str | None = None) -> Iterator[None]:
    """The global random generators (the CPU's, and `device`'s where it is a CUDA device) as they were before the
    block: modules built only to be overwritten (a file's reference architecture, skeleton and masked convs) draw
    initial weights, and moved the user's random stream (a checkpoint saved in a notebook's training loop changed
    every later dropout, augmentation and shuffle)."""
    device = torch.device(device) if device is not None else None
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        yield
