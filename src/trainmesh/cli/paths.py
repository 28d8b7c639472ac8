"""Output paths checked before a run starts: a directory or file that can be created and written."""
from __future__ import annotations

import os
from pathlib import Path

from trainmesh.core.errors import ConfigError


def _existing_ancestor(path: Path) -> Path:
    for parent in [path, *path.parents]:
        if parent.exists():
            return parent
    return Path(".")


def _creatable(flag: str, path: Path, what: str) -> None:
    """``path`` does not exist yet: its nearest existing ancestor must be a writable directory."""
    base = _existing_ancestor(path.parent if path.parent != path else path)
    if not base.is_dir():
        raise ConfigError(flag, f"{str(path)!r}: {base} is a file, not a directory; give {what}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(flag, f"{str(path)!r}: {base} is not writable; give {what}")


def check_output_dir(flag: str, path: str) -> None:
    """``path`` is, or can be made, a writable directory."""
    p = Path(path)
    what = "a writable directory"
    if p.exists():
        if not p.is_dir():
            raise ConfigError(flag, f"{path!r} is a file; give {what}")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(flag, f"{path!r} is not writable; give {what}")
        return
    _creatable(flag, p, what)


def check_output_file(flag: str, path: str) -> None:
    """``path`` is, or can be made, a writable file (not a directory)."""
    p = Path(path)
    what = "a file path in a writable directory"
    if p.is_dir():
        raise ConfigError(flag, f"{path!r} is a directory; give {what}")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ConfigError(flag, f"{path!r} is not writable; give {what}")
        return
    _creatable(flag, p, what)
