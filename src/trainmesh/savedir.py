"""One run per ``--save-dir``: an exclusive lock held for the run's lifetime.

The lock is ``flock`` on ``SAVE_DIR/.lock`` (which records the holder's pid for the message).
The kernel drops it when the holding process ends, however it ends, so the lock of a dead run
is simply taken over. The launcher holds it (rank 0 under torchrun/srun); a second run on the
same directory exits 2 naming it before any worker starts. Under the lock, the run's rank 0
removes the temporary directories (``.step-*.tmp``) that an interrupted save left behind, at
start and at every elastic restart.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from .errors import ConfigError

LOCK_FILE = ".lock"


class SaveDirLock:
    """``with SaveDirLock(path):`` the run owns ``path``; raises ConfigError("save-dir") if busy."""

    def __init__(self, save_dir: str | os.PathLike) -> None:
        self.dir = Path(save_dir)
        self._file: IO[str] | None = None

    def __enter__(self) -> "SaveDirLock":
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            f = (self.dir / LOCK_FILE).open("a+")
        except OSError as exc:
            raise ConfigError("save-dir", f"cannot use {str(self.dir)!r}: {exc.strerror}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise ConfigError("save-dir", f"{str(self.dir)!r} is in use by another run (pid {holder}); "
                              "wait for it to end or choose another directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()   # closing the descriptor releases the lock
            self._file = None


def remove_stale_tmp(save_dir: Path) -> list[Path]:
    """Remove the ``.step-*.tmp`` directories of interrupted saves; returns what was removed.
    Only rank 0 of the run holding the lock, before its first step (no save is in flight)."""
    stale = sorted(save_dir.glob(".step-*.tmp"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
