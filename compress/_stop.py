"""SIGTERM (a batch system ending or preempting a job, `kill`) or Ctrl-C (SIGINT) during training, without losing
the steps trained.

- `sigterm_raises()`: SIGTERM raises `Terminated` (train.py, around the whole run).
- `StepStop`: within the training loop the first SIGTERM or Ctrl-C is only noted; the loop asks `due()` after each
  step and, once it says so, writes last.pt at that step and raises `Terminated` itself. A second Ctrl-C raises at
  once. A second SIGTERM raises at once, unless it comes within `REPEAT_S` of the first: that is the same stop
  delivered twice (a batch system that signals every process of a job, as Slurm does, reaches each rank directly
  and through torchrun, which passes on the SIGTERM it gets, milliseconds apart; stopping at once lost every step
  since the last checkpoint; so is torchrun's SIGTERM after a Ctrl-C that reached every rank).
  Under DDP every rank must stop at the same step (the checkpoint write is collective), though the signal reaches
  the ranks at different steps, or only one of them: each step's flags are summed over the ranks in the background
  (one gloo all-reduce of an int per step, waited for at the next step, so no device sync and no wait in the
  step's critical path), and every rank reads the same answer one step later.

In processes forked from this one both handlers ignore the signals. (DataLoader workers set their own handlers;
they ignore SIGTERM through `compress.data`'s worker_init_fn: a worker that a batch system's SIGTERM ended would
fail this process's next batch before it could write its checkpoint.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as torch_dist

__all__ = ["Terminated", "sigterm_raises", "StepStop"]

REPEAT_S = 3.0  # a SIGTERM this soon after the first is the same stop delivered again (StepStop)


class Terminated(SystemExit):
    """The run stopped on SIGTERM (or Ctrl-C: `signum` SIGINT); the process exits with status 128 + the signal's
    number (143, 130), as the signal's default would. `where`: what was saved (e.g. "last.pt holds step 12 ..."),
    else the general note."""

    def __init__(self, where: str | None = None, signum: int = signal.SIGTERM) -> None:
        super().__init__(128 + signum)
        self.where, self.signum = where, signum

    def __str__(self) -> str:
        return f"{signal.Signals(self.signum).name}; " + (
            self.where or "resume=true continues from the run's last checkpoint, if it wrote one (last.pt: at each "
                          "epoch's end, every trainer.checkpoint_every steps, and at the step a SIGTERM or Ctrl-C "
                          "during training stops)")


@contextlib.contextmanager
def _on_signal(signum: int, action: Callable[[], None]) -> Iterator[None]:
    """Within: the signal calls `action()` in this process and is ignored in processes forked from it; the previous
    handler comes back after. Outside the main thread (where Python cannot set handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def handler(signum, frame) -> None:
        if os.getpid() == pid:
            action()

    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _raise() -> None:
    raise Terminated()


def sigterm_raises() -> contextlib.AbstractContextManager[None]:
    """Within: SIGTERM raises `Terminated` in this process (forked processes ignore it)."""
    return _on_signal(signal.SIGTERM, _raise)


class StepStop:
    """Use as `with StepStop(group) as stop:` around the training loop and call `stop.due()` after every step
    (every rank, the same steps): True once a SIGTERM or Ctrl-C was seen (by any rank, for `group` a gloo group of
    all ranks, or None for one process), on every rank at the same call; `signum` is the signal that asked.
    `due(now=True)` also counts a signal seen since the last call (a blocking all-reduce: use it where steps do not
    follow, e.g. at an epoch's end)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.requested = False  # this process saw SIGTERM or SIGINT
        self.signum = signal.SIGTERM  # which one, first
        self._first = 0.0  # when (time.monotonic())
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._pending = None  # the all-reduce of the last call's flags
        self._handlers: list[contextlib.AbstractContextManager] = []

    def _note(self, signum: int) -> None:
        now = time.monotonic()
        if self.requested:  # a second Ctrl-C, or a second SIGTERM that is not the first one again: stop now
            if (signum == signal.SIGINT and self.signum == signal.SIGINT) or now - self._first > REPEAT_S:
                raise Terminated(signum=signum)
            return
        self.requested, self._first, self.signum = True, now, signum
        if signum == signal.SIGINT:
            print("\nCtrl-C: the run stops after this step and writes last.pt there (resume=true continues); press "
                  "Ctrl-C again to stop at once", file=sys.stderr, flush=True)

    def __enter__(self) -> StepStop:
        self._handlers = [_on_signal(signal.SIGTERM, lambda: self._note(signal.SIGTERM)),
                          _on_signal(signal.SIGINT, lambda: self._note(signal.SIGINT))]
        for handler in self._handlers:
            handler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._pending is not None and exc[0] is None:  # no collective left behind
                self._pending.wait()
        finally:
            self._pending = None
            for handler in reversed(self._handlers):
                handler.__exit__(*exc)

    def due(self, now: bool = False) -> bool:
        if self.group is None:
            return self.requested
        if self._pending is not None:  # the flags of the last call, summed in the background since
            self._pending.wait()
            self._pending = None
            if self._flag.item():
                return True
        self._flag.fill_(int(self.requested))
        self._pending = torch_dist.all_reduce(self._flag, group=self.group, async_op=True)
        if not now:
            return False
        self._pending.wait()
        self._pending = None
        return bool(self._flag.item())
