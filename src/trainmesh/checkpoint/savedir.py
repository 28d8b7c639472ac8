"""One run per ``--save-dir``: an exclusive lock held for the run's lifetime.

The lock is ``flock`` on the directory itself (its open descriptor), so no lock file is left
behind; while it is held, ``SAVE_DIR/.lock`` records the holder's pid for the message and is
removed before the lock is released (a crashed run's stale one is only informative). The
kernel drops the lock when the holding process ends, however it ends, so the lock of a dead
run is simply taken over. The launcher holds it (rank 0 under torchrun/srun); a second run on the
same directory exits 2 naming it before any worker starts. Under the lock, the run's rank 0
removes the temporary directories (``.step-*.tmp``) that an interrupted save left behind, at
start and at every elastic restart.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from trainmesh.core.errors import ConfigError

LOCK_FILE = ".lock"


class SaveDirLock:
    """``with SaveDirLock(path):`` the run owns ``path``; raises ConfigError("save-dir") if busy."""

    def __init__(self, save_dir: str | os.PathLike) -> None:
        self.dir = Path(save_dir)
        self._fd: int | None = None

    def __enter__(self) -> "SaveDirLock":
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise ConfigError("save-dir", f"cannot use {str(self.dir)!r}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = (self.dir / LOCK_FILE).read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise ConfigError("save-dir", f"{str(self.dir)!r} is in use by another run (pid {holder}); "
                              "wait for it to end or choose another directory") from None
        self._fd = fd
        try:
            (self.dir / LOCK_FILE).write_text(f"{os.getpid()}\n")
        except OSError:
            pass   # the pid is only for the message
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            (self.dir / LOCK_FILE).unlink(missing_ok=True)   # under the lock: no other run writes it
            os.close(self._fd)   # closing the descriptor releases the lock
            self._fd = None


def remove_stale_tmp(save_dir: Path) -> list[Path]:
    """Remove the ``.step-*.tmp`` directories of interrupted saves; returns what was removed.
    Only rank 0 of the run holding the lock, before its first step (no save is in flight)."""
    stale = sorted(save_dir.glob(".step-*.tmp"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
