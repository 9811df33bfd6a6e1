"""Atomic file writes for checkpoints and compact model files; reading safetensors files; strict JSON text; removing
a Hydra run dir that holds nothing else; lock files."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import secrets
import shutil
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "json_text", "launch_path", "lock_file", "process_alive", "read_safetensors",
           "remove_if_only_hydra", "unlock_file"]


def read_safetensors(path: Path) -> tuple[dict[str, str], dict]:
    """(metadata, tensors) of the safetensors file at `path`, read whole; each tensor in PyTorch memory of its own
    (no memory map, no storage shared between tensors). Not through safetensors' safe_open/get_tensor, which (0.8)
    keeps about 60 bytes per tensor for the life of the process: a service that reloads a model grew without bound.
    Raises safetensors' own errors for a damaged file."""
    from safetensors.torch import load

    data = path.read_bytes()
    loaded = load(data)  # (checks the header and every tensor's extent first)
    metadata = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
    del data
    return metadata, {name: loaded.pop(name).clone() for name in sorted(loaded)}  # (as safe_open lists them)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` to fill a temporary file next to `path`, flush it to disk (fsync), give it the permissions a
    new file gets under the umask, then rename it onto `path` and fsync the folder: a reader sees the old file or the
    whole new one, also after a crash or power loss. A failed write (a full disk) leaves `path` as it was and raises
    OSError naming it. A symbolic link is written through (its target is replaced, the link stays); a path that is
    not a regular file (a device such as /dev/null, a FIFO) is refused. Temporary files of `path` that killed
    processes left (``.<name>.tmp<pid>.<random>``) are removed (`_remove_stale_temporaries`)."""
    from safetensors import SafetensorError

    given = Path(path)
    path = Path(os.path.realpath(given))  # through symbolic links: os.replace would replace the link itself
    if path.is_dir():
        raise IsADirectoryError(f"could not write {given}: it is a directory; give a file path")
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        raise OSError(f"could not write {given}: it is not a regular file (a device, FIFO or socket), which a "
                      "write by rename would replace; give a file path")
    # (the random part: processes of two containers sharing the folder can have one process id)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{secrets.token_hex(4)}")
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(path)
            write(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        # torch.save reports a full disk as a RuntimeError, safetensors as its SafetensorError
        except (OSError, RuntimeError, SafetensorError) as err:
            detail = " ".join(str(err).split())[:300]
            raise OSError(f"could not write {given} ({type(err).__name__}: {detail}); check that its folder is "
                          f"writable and the disk has room. The previous {given.name}, if any, is unchanged") from err
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates its files owner-only
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        with contextlib.suppress(OSError):  # (a folder that is a file: the error above says so, not this one)
            tmp.unlink(missing_ok=True)
    return given


STALE_AFTER_S = 600  # a temporary file untouched this long, of no process running here, is a killed writer's


def _remove_stale_temporaries(path: Path) -> None:
    """Remove ``.<name>.tmp<pid>[.<random>]`` files beside `path` left by killed writers: of a process that no longer
    runs here and untouched for STALE_AFTER_S. (By process id alone, a save in another container or on another host
    sharing the folder, whose process this one cannot see, lost its file mid-write.)"""
    prefix = f".{path.name}.tmp"
    for entry in path.parent.glob(glob.escape(prefix) + "*"):
        pid = entry.name[len(prefix):].partition(".")[0]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if time.time() - entry.stat().st_mtime > STALE_AFTER_S:
                entry.unlink()


def json_text(value) -> str:
    """`value` as indented JSON text (with a final newline), each non-finite float (NaN, inf) written as null:
    json.dumps would write bare NaN, which strict JSON readers (JavaScript, jq --strict) reject."""
    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), indent=2, allow_nan=False) + "\n"


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_if_only_hydra(run_dir: Path, log_name: str | None = None) -> bool:
    """Delete `run_dir` when all it holds is what Hydra writes at a job's start (.hydra/*.yaml and an empty
    `log_name`, the job's log file, where the job has one), and, where Hydra named it (no hydra.run.dir /
    hydra.sweep.dir on the command line), the folders above it inside the launch directory that this leaves empty
    (outputs/<date>; a folder of the user's own, such as myruns/ of hydra.run.dir=myruns/r1, stays); return
    whether `run_dir` was deleted. A process inside `run_dir` (hydra.job.chdir=true) first goes back to the launch
    directory, as Hydra does after the job."""
    entries = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else {"?"}
    hydra = run_dir / ".hydra"
    only_yaml = not hydra.exists() or all(p.suffix == ".yaml" and p.is_file() for p in hydra.iterdir())
    log = run_dir / log_name if log_name else None
    if not (entries <= {".hydra", log_name} and only_yaml and (log is None or not log.exists() or log.stat().st_size == 0)):
        return False
    run_dir, launch = run_dir.resolve(), _launch_dir()
    cwd = Path.cwd().resolve()
    if cwd == run_dir or run_dir in cwd.parents:
        os.chdir(launch)
    shutil.rmtree(run_dir, ignore_errors=True)
    for folder in run_dir.parents if _named_by_hydra() else ():
        if launch not in folder.parents:
            break
        try:
            folder.rmdir()  # only if empty
        except OSError:
            break
    return not run_dir.exists()


def lock_file(path: Path) -> int | None:
    """An open descriptor of `path` (created if absent) that holds an exclusive lock on it, or None while another
    process holds that lock. The OS drops a lock when its descriptor is closed or its process ends (kill -9 too), so
    a lock is never stale and two processes can never both hold one (a lock written as a file's contents can be:
    two processes that each find a stale one both take it over). Release it with `unlock_file`. Where the file
    system cannot lock files (some network mounts), or without fcntl (not POSIX), the descriptor comes back
    unlocked, with a warning."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    for _ in range(8):
        try:
            fd, writable = os.open(path, os.O_CREAT | os.O_RDWR, 0o644), True
        except PermissionError:  # another user's file: a read-only descriptor can hold the lock too
            fd, writable = os.open(path, os.O_RDONLY), False
        try:
            if fcntl is None:
                raise OSError("no fcntl on this platform")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            warnings.warn(f"could not lock {path} ({e}): nothing keeps a second process out of what it guards",
                          RuntimeWarning, stacklevel=2)
            return fd
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same and writable:
            return fd
        if same:  # another user's file that no process holds: replace it with one of ours (the folder allows it)
            os.unlink(path)
        os.close(fd)  # else its holder removed the file between our open and our lock: lock the file there now
    raise OSError(f"could not lock {path}: other processes keep removing and creating it")


def unlock_file(path: Path, fd: int) -> None:
    """Release `lock_file`'s lock: remove `path`, then close `fd` (in this order, so that a process that opened the
    old file and then gets its lock sees that it is gone)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (another user's included)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _named_by_hydra() -> bool:
    """Whether the job's directory is Hydra's default (outputs/<date>/<time>, multirun/...), not one given with
    hydra.run.dir or hydra.sweep.dir."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True
    given = {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.hydra}
    return not given & {"hydra.run.dir", "hydra.sweep.dir"}


def _launch_dir() -> Path:
    """The directory the command was started in: Hydra's original working directory, else the current one."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    return Path(get_original_cwd() if HydraConfig.initialized() else os.getcwd()).resolve()


def launch_path(path: str | os.PathLike) -> Path:
    """`path` (~ expanded) made absolute against the directory the command was started in, not the run dir
    `hydra.job.chdir=true` moves into. ValueError naming it for a path that cannot be resolved (a symlink loop)."""
    try:
        return (_launch_dir() / Path(str(path)).expanduser()).resolve()
    except (RuntimeError, OSError) as err:  # Python 3.11-3.12 raise RuntimeError for a symlink loop
        raise ValueError(f"{path}: cannot resolve this path ({err}); give a path to a file or folder") from None
