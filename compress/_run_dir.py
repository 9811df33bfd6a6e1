"""Hydra hooks of train.py and export.py (conf/train.yaml, conf/export.yaml) for the run directory, which Hydra
creates before any of our code runs: a run dir it cannot create failed with three chained pathlib tracebacks, and
`hydra.run.dir=~/runs/x` made a folder named '~' in the current directory.

- `RunDirCheck`, a Hydra callback: before Hydra creates hydra.run.dir (hydra.sweep.dir for -m), a ValueError that
  names the setting and the fix when that directory cannot be made (a '~' Hydra would not expand, a symbolic link to
  a missing target, a read-only parent).
- the `compress_export_run_dir` resolver: export.py's run dir, which holds only Hydra's record of the command when
  `out=` is given (removed again after the export), goes to the system's temporary folder then, so that an export
  into out= works from a read-only working directory (a container's, a read-only checkout).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["RunDirCheck", "check_run_dir", "export_run_dir"]


def check_run_dir(value: str, key: str) -> None:
    """ValueError naming `key` (the setting that gave `value`) when Hydra cannot create the directory `value` (relative
    to the current directory): it starts with '~', a folder on its path is a symbolic link whose target does not
    exist, or no folder can be created in its nearest existing folder (probed: one created and removed again)."""
    if value.startswith("~"):
        raise ValueError(f"{key}={value}: Hydra does not expand '~' (it would create a folder named '~' in "
                         f"{os.getcwd()}); give the full path: {key}={os.path.expanduser(value)}")
    path = Path(value).absolute()
    for folder in (path, *path.parents):
        if folder.is_symlink() and not folder.exists():
            raise ValueError(f"{key}={value}: {folder} is a symbolic link to {os.readlink(folder)}, which does not "
                             f"exist (a drive not mounted?); create its target or give another {key}")
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"{key}={value}: {folder} is a file, not a folder; give another {key}")
            if folder != path:
                try:  # a real probe: os.access says yes to root on an immutable folder
                    os.rmdir(tempfile.mkdtemp(prefix=".compress-probe-", dir=folder))
                except OSError as err:
                    raise ValueError(f"{key}={value}: cannot create the run directory {path} in {folder} "
                                     f"({err.strerror or err}); give {key}=<a writable directory>") from None
            return


class RunDirCheck(Callback):
    """`check_run_dir` of hydra.run.dir before a run, of hydra.sweep.dir before a sweep (-m). Its error stops the
    command as SystemExit with the message alone (status 1): Hydra turns any Exception a callback raises into a
    warning and goes on to its own traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _exit_on_error(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _exit_on_error(str(config.hydra.sweep.dir), "hydra.sweep.dir")


def _exit_on_error(value: str, key: str) -> None:
    try:
        check_run_dir(value, key)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def export_run_dir(out: str | None, default: str) -> str:
    """export.py's hydra.run.dir: `default` (outputs/export/<date>/<time>) without `out`; given `out`, a folder in
    the system's temporary directory named by the process and the time (Hydra creates it and writes its record
    there; export.py removes it after the export)."""
    if out is None:
        return default
    return os.path.join(tempfile.gettempdir(), f"compress-export-{os.getpid()}-{time.time_ns()}")


OmegaConf.register_new_resolver("compress_export_run_dir", export_run_dir, use_cache=True, replace=True)
