"""Run train.py or export.py inside the test process, as their command line would (tests only).

A subprocess pays Python's, torch's and torch._dynamo's start-up per call (4-5 s on the 2-core CI box), more than
most CLI tests train. Here the script's Hydra main runs in this process instead: the same argument parsing, run
directory, .hydra/ record, logging to train.log and exit status. The tests that need a fresh process (what a start
imports, torchrun, the quick-start entry point) still start one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_scripts: dict[str, object] = {}


@dataclass
class Result:
    """What a subprocess.run(..., capture_output=True, text=True) of the script would return."""

    returncode: int
    stdout: str
    stderr: str


def _script(name: str):
    """The module of ROOT/`name`, loaded once. Its Hydra main is marked as `__main__`'s, so Hydra finds conf/ beside
    the script file as it does for `python <name>` (it looks a module's config up as a package otherwise)."""
    if name not in _scripts:
        spec = importlib.util.spec_from_file_location(f"_cli_{Path(name).stem}", ROOT / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.main.__wrapped__.__module__ = "__main__"
        _scripts[name] = module
    return _scripts[name]


def _loggers() -> dict[logging.Logger, tuple]:
    """Every logger's state that Hydra's logging config sets (export.yaml's `disabled` job logging disables all
    existing loggers)."""
    loggers = [logging.getLogger(), *(v for v in logging.root.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return {lg: (lg.handlers[:], lg.level, lg.disabled, lg.propagate) for lg in loggers}


def run_script(name: str, *args: str, cwd: Path = ROOT) -> Result:
    """`python <ROOT/name> *args` run from `cwd`, in this process: its exit status, stdout and stderr (Hydra prints
    a failed run's error to stderr and exits 1). Restores the working directory, sys.argv, Hydra's config singleton
    and every logger."""
    from hydra.core.hydra_config import HydraConfig

    main = _script(name).main
    loggers, argv, old_cwd = _loggers(), sys.argv, os.getcwd()
    hydra_cfg = HydraConfig.instance().cfg  # (a job restores it; --cfg/--help print and leave theirs behind, whose
    # runtime.cwd later in-process code would take for the launch directory)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = [str(ROOT / name), *args]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):  # what Python prints for an uncaught SystemExit("message")
            err.write(e.code + "\n")
    finally:
        os.chdir(old_cwd)
        sys.argv = argv
        HydraConfig.instance().cfg = hydra_cfg
        for logger, (handlers, level, disabled, propagate) in loggers.items():
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()  # Hydra's handlers for this run (its train.log and console)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.disabled, logger.propagate = disabled, propagate
    return Result(code, out.getvalue(), err.getvalue())
