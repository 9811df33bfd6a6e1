"""Run logging for the engine: TensorBoard scalars and skeleton heatmaps, progress bars, summary text.

Only rank 0 logs; on other ranks (or with enabled=False) every method is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from tqdm import tqdm

from compress.skeleton import SkeletonConv2d

__all__ = ["RunLogger", "progress", "skeleton_heatmap", "format_summary", "say", "log_failure", "warnings_in_log_files"]

_log = logging.getLogger("compress")


def say(text: str, write: Callable[[str], object] = print) -> None:
    """Show `text` on the terminal with `write` (print, or a progress bar's write) and log it at INFO: under train.py,
    Hydra's job logging (conf/hydra/job_logging/train.yaml) puts it in <run dir>/train.log."""
    write(text)
    _log.info(text)


def _file_handlers() -> list[logging.FileHandler]:
    """The file handlers the run's messages reach (under train.py, Hydra's job logging: <run dir>/train.log)."""
    found, logger = [], _log
    while logger is not None:
        found += [h for h in logger.handlers if isinstance(h, logging.FileHandler) and h not in found]
        logger = logger.parent if logger.propagate else None
    return found


def _to_log_files(level: int, text: str, exc_info=None, run_dir: Path | None = None) -> None:
    """Write `text` into the log files only: the terminal has shown it already (a warning) or will (an error).
    With `run_dir`: into the files of the same names there, if they exist, instead (another DDP rank's way into
    rank 0's train.log)."""
    record = _log.makeRecord(_log.name, level, __file__, 0, text, None, exc_info)
    for handler in _file_handlers():
        if level < handler.level:
            continue
        if run_dir is None:
            handler.handle(record)
        elif (path := Path(run_dir) / Path(handler.baseFilename).name).is_file():
            with open(path, "a") as f:
                f.write(handler.format(record) + "\n")


def log_failure(err: BaseException, rank: int = 0, run_dir: Path | None = None) -> None:
    """Put the error that stopped a run, with its traceback, into the run's log files (train.log), so that a batch
    job's log says why it ended; the terminal shows Python's own report of it. Another DDP rank (`rank` > 0; rank 0
    may only see that a peer's connection closed) appends it, naming itself, to the files of those names in
    `run_dir`, the run's (its own Hydra log may lie in a folder of its own)."""
    text = ("" if rank == 0 else f"rank {rank}: ") + f"the run stopped: {type(err).__name__}: {err}"
    _to_log_files(logging.ERROR, text, (type(err), err, err.__traceback__), None if rank == 0 else run_dir)


@contextlib.contextmanager
def warnings_in_log_files(enabled: bool = True, run_dir: Path | None = None):
    """While the run works, every warning shown (on stderr, as Python shows it) also goes into the log files, so
    that train.log holds what the terminal showed. (logging.captureWarnings would take warnings off stderr, and off
    warnings.catch_warnings(record=True) callers such as pytest.warns: this chains to the previous display.)
    Yields `forget()`, which truncates the log files inside `run_dir` (which the run lock keeps to this run) back to
    their size at the start: a command refused before its run began leaves the run dir's log as it found it (a
    fresh dir's empty log: the dir is then removed). Log files elsewhere are never truncated."""
    inside = [h.baseFilename for h in _file_handlers() if run_dir is not None
              and Path(h.baseFilename).resolve().parent == Path(run_dir).resolve()] if enabled else []
    sizes = {path: os.path.getsize(path) if os.path.exists(path) else 0 for path in inside}

    def forget() -> None:
        for path, size in sizes.items():
            with contextlib.suppress(OSError):
                if os.path.getsize(path) > size:
                    os.truncate(path, size)

    if not enabled:
        yield forget
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        _to_log_files(logging.WARNING, warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield forget
    finally:
        warnings.showwarning = shown


def progress(iterable, enabled: bool, **kwargs) -> tqdm:
    """A tqdm bar, shown only when `enabled` and stderr is a terminal."""
    return tqdm(iterable, disable=not (enabled and sys.stderr.isatty()), dynamic_ncols=True, **kwargs)


def skeleton_heatmap(conv: SkeletonConv2d, threshold: float, scale: int = 4) -> torch.Tensor:
    """Image (H, W) in [0, 1] of one skeleton: a row per filter, a column per (kh, kw) offset.

    Values are |FS| / max|FS| for kept stripes and 0 for pruned ones; each cell is `scale` pixels
    wide and high (H = out_channels * scale, W = kh * kw * scale).
    """
    fs = conv.stripe_scale().float().abs().flatten(1).cpu()  # a grouped skeleton's rows repeated per filter
    fs = fs * conv.stripe_mask(threshold).flatten(1).cpu()
    img = fs / fs.max().clamp_min(1e-12)
    return img.repeat_interleave(scale, 0).repeat_interleave(scale, 1)


class RunLogger:
    """TensorBoard writer at `log_dir` (created lazily, rank 0 only). A write that fails (a full disk, a folder made
    read-only) stops the logging with one warning naming the folder, not the run: the checkpoints, written
    separately, are what a run must not lose."""

    def __init__(self, log_dir: str | Path, enabled: bool, purge_step: int | None = None):
        """`purge_step`: the first step this run logs (on resume, the first not in the checkpoint); TensorBoard hides
        events from that step on that earlier processes wrote (a killed run's steps after its last checkpoint, or
        before its first, which this run logs again)."""
        self.writer, self.log_dir = None, Path(log_dir)
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def _write(self, write: Callable) -> None:
        if self.writer is None:
            return
        try:
            write(self.writer)
        except OSError as err:
            writer, self.writer = self.writer, None
            with contextlib.suppress(Exception):
                writer.close()
            warnings.warn(f"TensorBoard logging stopped: could not write into {self.log_dir} ({err}); the run goes on "
                          "without it (its checkpoints and train.log are written as before)", RuntimeWarning,
                          stacklevel=3)

    def scalars(self, values: dict[str, float], step: int) -> None:
        def write(writer):
            for key, value in values.items():
                writer.add_scalar(key, value, step)

        self._write(write)

    def skeletons(self, model: nn.Module, stats: dict, threshold: float, step: int) -> None:
        """Per-layer stripes kept (fraction), the total, and one heatmap image per skeleton layer."""
        if not stats["layers"]:
            return

        def write(writer):
            for name, layer in stats["layers"].items():
                writer.add_scalar(f"stripes_kept/{name}", layer["stripes_kept"] / layer["stripes_total"], step)
                conv = model.get_submodule(name)
                writer.add_image(f"skeleton/{name}", skeleton_heatmap(conv, threshold), step, dataformats="HW")
            writer.add_scalar("stripes_kept/total", stats["stripes_kept"] / stats["stripes_total"], step)
            writer.add_scalar("stripes_kept/count", stats["stripes_kept"], step)

        self._write(write)

    def close(self) -> None:
        self._write(lambda writer: writer.close())
        self.writer = None


def _fraction(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def format_summary(summary: dict) -> str:
    """A short multi-line text of the run summary for the terminal. A model without skeleton convs (prune=none,
    or a compact model fine-tuned with init=) has no skeleton figures: its MACs and params are its own, and a
    compact model's line counts the stripes its stripe convs keep."""
    total = summary["stripes_total"]
    if total:
        macs_ratio = summary["macs_pruned_estimate"] / max(summary["macs_dense"], 1)
        stripes = [
            f"stripes kept    {summary['stripes_kept']} / {total}"
            f"  ({summary['stripes_kept'] / total:.1%}), dead filters {summary['filters_dead']}",
            f"MACs            {summary['macs_dense'] / 1e6:.2f} M dense -> {summary['macs_pruned_estimate'] / 1e6:.2f} M"
            f" estimated ({macs_ratio:.1%})" + (
                f", {summary['macs_compact'] / 1e6:.2f} M in the compact model "
                f"({summary['macs_compact'] / max(summary['macs_dense'], 1):.1%})"
                if summary.get("macs_compact") is not None else ""),
            f"params          {summary['params'] / 1e6:.3f} M (dense)",
        ]
    else:
        compact = summary.get("compact_stripes") or {}
        stripes = [
            f"stripes         {compact['stripes_kept']} / {compact['stripes_total']} kept in the compact model's "
            f"{compact['layers']} stripe convs, out of their filters' stripes (fine-tuning keeps them; export's "
            "report counts them out of the dense model's layers)" if compact.get("layers")
            else "stripes         no skeleton convs in this model",
            f"MACs            {summary['macs_dense'] / 1e6:.2f} M",
            f"params          {summary['params'] / 1e6:.3f} M",
        ]
    return "\n".join(
        [
            f"== {summary['model']} on {summary['data']} ({summary['device']}) ==",
            f"test accuracy   {_fraction(summary['test_accuracy'])}  (best {_fraction(summary['best_test_accuracy'])})",
            *stripes,
            f"epochs / steps  {summary['epochs']} / {summary['steps']} in {summary['seconds']:.1f} s",
            f"run dir         {summary['run_dir']}",
            f"checkpoint      {summary['checkpoint']}",
        ]
    )
