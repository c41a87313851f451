"""The run directory of an engine's swap files under ``offload.nvme_path``, and stale ones of dead runs.

[Note: run directories] Each engine keeps its swap files in one directory of
its own, ``<nvme_path>/zkernel-run-<host>-<pid>-<token>`` (mode 0700, files
0600), which both of its ``nvme`` tiers (optimizer state and parameter shards)
share. The directory holds a lock file that the live process keeps locked
with ``flock(LOCK_EX)`` for as long as the engine lives; the kernel drops the
lock when the process dies, however it dies. So at the next start a directory
whose lock can be taken belongs to a dead run (killed, crashed, power lost)
and is removed, and one whose lock cannot be taken belongs to a live run, of
this process (another engine) or of another process sharing the path, and is
never touched. A directory is created under a temporary name and renamed once
its lock is held, so no scan ever sees a run directory without its lock.

The directory is removed when the last tier using it closes (`Engine.close`,
the engine's finalizer, the interpreter's exit) and, as a backstop for tiers
that were never closed (an `initialize` that failed half way), when the
`RunDirectory` object is garbage-collected or the interpreter exits.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path

from zkernel.spec.config import ConfigError
from zkernel.telemetry.log import get_logger

log = get_logger()

RUN_PREFIX = "zkernel-run-"
_NEW_PREFIX = ".zkernel-new-"
LOCK_NAME = "lock"
# A directory still being created holds a lock file that is not locked yet for a few microseconds;
# one older than this was left by a process that died while creating it.
_UNLOCKED_GRACE_S = 60.0


def _take_lock(path: Path) -> int | None:
    """An fd holding ``flock(LOCK_EX)`` on ``path``, or None when a live process holds it or it is gone."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale_runs(root: Path) -> list[Path]:
    """Remove the run directories under ``root`` whose lock no live process holds; return them."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not (entry.name.startswith(RUN_PREFIX) or entry.name.startswith(_NEW_PREFIX)) or not entry.is_dir():
            continue
        lock = entry / LOCK_NAME
        if entry.name.startswith(_NEW_PREFIX):
            # Being created (its lock file may exist and not be locked yet): only a leftover of a
            # process that died while creating it, long ago, is removed.
            try:
                old = time.time() - entry.stat().st_mtime > _UNLOCKED_GRACE_S
            except OSError:
                continue
            fd = _take_lock(lock) if old and lock.exists() else None
            if old and (fd is not None or not lock.exists()):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
            if fd is not None:
                os.close(fd)
            continue
        fd = _take_lock(lock)
        if fd is None:
            continue  # a live run's
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    if removed:
        log.info("zkernel.nvme.stale_runs_removed", root=str(root), count=len(removed), dirs=[p.name for p in removed])
    return removed


def _remove(path: str, fd: int) -> None:
    """Finalizer: remove the directory, then drop the lock (never raises)."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


class RunDirectory:
    """One engine's swap-file directory (see [Note: run directories]); use `RunDirectory.acquire`."""

    def __init__(self, root: Path) -> None:
        remove_stale_runs(root)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=_NEW_PREFIX, dir=root))
        except OSError as exc:
            raise ConfigError(
                f"offload.nvme_path {str(root)!r} is not writable ({exc.strerror or exc}); "
                "give a directory this process can create files in"
            ) from exc
        fd = -1
        try:
            fd = os.open(tmp / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            final = root / f"{RUN_PREFIX}{socket.gethostname()}-{os.getpid()}-{tmp.name.removeprefix(_NEW_PREFIX)}"
            os.rename(tmp, final)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(
                f"offload.nvme_path {str(root)!r}: cannot create a run directory ({exc.strerror or exc})"
            ) from exc
        self.path = final
        self._users = 0
        self._finalizer = weakref.finalize(self, _remove, str(final), fd)
        log.debug("zkernel.nvme.run_dir", path=str(final))

    # -- sharing between the two tiers of one engine ----------------------------------

    _lock = threading.Lock()
    _shared: dict[int, RunDirectory] = {}

    @classmethod
    def acquire(cls, root: str | os.PathLike, owner: object) -> RunDirectory:
        """The run directory of the engine that ``owner`` (an object unique to the engine) belongs to,
        created on first use; every `acquire` is matched by one `release`."""
        root = check_nvme_path(root)
        with cls._lock:
            run = cls._shared.get(id(owner))
            if run is None or not run.alive:
                run = cls(root)
                cls._shared[id(owner)] = run
            elif run.path.parent != root:
                raise ConfigError(
                    f"the engine's nvme tiers were given two offload.nvme_path values: {str(run.path.parent)!r} and {str(root)!r}"
                )
            run._users += 1
            run._owner = id(owner)
            return run

    def release(self) -> None:
        """One user is done; the last one removes the directory and its lock."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            if self._shared.get(self._owner) is self:
                del self._shared[self._owner]
        self._finalizer()
        log.debug("zkernel.nvme.run_dir_removed", path=str(self.path))

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def file(self, name: str) -> Path:
        return self.path / name


def check_nvme_path(path: str | os.PathLike) -> Path:
    """``path`` as an absolute `Path`, or `ConfigError` when it is missing or not a directory."""
    root = Path(path).expanduser().absolute()
    if not root.exists():
        raise ConfigError(
            f"offload.nvme_path {str(root)!r} does not exist; create the directory (on the NVMe disk) or give another"
        )
    if not root.is_dir():
        raise ConfigError(f"offload.nvme_path {str(root)!r} is not a directory")
    return root
