"""Hydra hooks of train.py and export.py (conf/train.yaml, conf/export.yaml) for the run directory, which Hydra
creates before any of our code runs: a run dir it cannot create failed with three chained pathlib tracebacks, and
`hydra.run.dir=~/runs/x` made a folder named '~' in the current directory.

- `RunDirCheck`, a Hydra callback: before Hydra creates hydra.run.dir (hydra.sweep.dir for -m), an error that
  names the setting and the fix when that directory cannot be made (a '~' Hydra would not expand, a symbolic link to
  a missing target, a read-only parent).
- `ExportSweepCheck`, export.py's: a sweep (-m) of several jobs with one fixed `out=` is refused (each job wrote
  its files over the previous one's).
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

__all__ = ["RunDirCheck", "ExportSweepCheck", "check_run_dir", "export_run_dir"]


def check_run_dir(value: str, key: str) -> None:
    """ValueError naming `key` (the setting that gave `value`) when Hydra cannot create or write the directory
    `value` (relative to the current directory): it starts with '~', a folder on its path is a symbolic link whose
    target does not exist, or nothing can be created in it (an existing run dir: resume) or in its nearest existing
    folder (probed: a folder created and removed again)."""
    if value.startswith("~"):
        home = os.path.expanduser(value)
        raise ValueError(f"{key}={value}: Hydra does not expand '~' (it would create a folder named '~' in "
                         f"{os.getcwd()}); give the full path" + (f": {key}={home}" if home != value else ""))
    path = Path(value).absolute()
    for folder in (path, *path.parents):
        if folder.is_symlink() and not folder.exists():
            raise ValueError(f"{key}={value}: {folder} is a symbolic link to {os.readlink(folder)}, which does not "
                             f"exist (a drive not mounted?); create its target or give another {key}")
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"{key}={value}: {folder} is a file, not a folder; give another {key}")
            try:  # a real probe: os.access says yes to root on an immutable folder or a read-only mount
                os.rmdir(tempfile.mkdtemp(prefix=".compress-probe-", dir=folder))
            except OSError as err:
                what = f"cannot write into the run directory {path}" if folder == path else \
                    f"cannot create the run directory {path} in {folder}"
                raise ValueError(f"{key}={value}: {what} ({err.strerror or err}); give {key}=<a writable "
                                 "directory>") from None
            return


class RunDirCheck(Callback):
    """`check_run_dir` of hydra.run.dir before a run, of hydra.sweep.dir before a sweep (-m). Its error stops the
    command as SystemExit with the message alone (status 1): Hydra turns any Exception a callback raises into a
    warning and goes on to its own traceback."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _exit_on_error(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _exit_on_error(str(config.hydra.sweep.dir), "hydra.sweep.dir")


class ExportSweepCheck(Callback):
    """export.py -m: refuses a fixed `out=` for a sweep of several jobs, which would each write their files into
    that one folder, over the previous job's (the last job's report alone remained)."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        given = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)  # as typed: out=X/${hydra:job.num}
        parsed = OverridesParser.create().parse_overrides(given)
        out = [o for o in parsed if o.key_or_group == "out" and not o.is_sweep_override()]
        # (Hydra keeps the overrides with interpolations escaped: out=X/$\{hydra\:job.num\})
        if out and not any(mark in (given := out[0].get_value_element_as_str()) for mark in ("${", "$\\{")) and \
                any(o.is_sweep_override() for o in parsed):
            raise SystemExit(f"error: export.py -m: every job of this sweep would write its files into out={given}, "
                             "each over the previous job's; leave out= unset (each job writes into its own folder "
                             "under hydra.sweep.dir) or make it differ per job, e.g. out='" + given +
                             "/${hydra:job.num}'")


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
