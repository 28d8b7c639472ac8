"""Token files read window by window, checked, and the token cache of tokenised text.

A token file (``.npy``, ``.bin`` as uint16, or a text file read as bytes) is opened once and
read with ``os.pread`` into small buffers: no process maps or holds the whole file, only the
windows of the batch it builds. Before each batch the file's identity (inode, size, mtime) is
compared with what was opened, and a short read is an error too, so a file truncated or
replaced while a run reads it stops the run with a :class:`~trainmesh.core.errors.DataError`
naming ``--data`` (exit 1), where a stale memory map would kill the process with SIGBUS.

Tokenised text (``--tokenizer bpe:V``) is written once, before any worker starts, to a ``.npy``
cache beside the text, or under ``$XDG_CACHE_HOME/trainmesh`` (``~/.cache/trainmesh``) when
the text's directory is not writable. Its name holds the tokenizer and the text's fingerprint
(size, mtime and the SHA-256 of its first MiB); it is written piece by piece to a temporary
file and renamed into place, so readers never see half a cache.
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmesh.core.errors import ConfigError, DataError

SCAN_TOKENS = 1 << 20
"""Tokens per read when a whole file is scanned (the id range check): 1 Mi, at most 8 MiB."""
FINGERPRINT_HEAD = 1 << 20
"""Bytes of the text's start hashed into its fingerprint."""
NPY_HEADER = 128
"""Bytes of the cache's ``.npy`` header: fixed, so the count is written after the tokens."""


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is still the one opened: device, inode, size, modification time."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class TokenFile:
    """An open token file: ``count`` ids of ``dtype`` from byte ``offset``, read with pread."""

    def __init__(self, path: str, *, dtype: np.dtype, offset: int, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.offset, self.shape = path, np.dtype(dtype), offset, shape
        self.count = int(np.prod(shape)) if shape else 1
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY)
        self.identity = FileIdentity.of(os.fstat(self._fd))
        if offset + self.count * self.dtype.itemsize > self.identity.size:
            self.close()
            raise ConfigError("--data", f"{path!r} is shorter ({self.identity.size} bytes) than "
                              f"its header says ({offset + self.count * self.dtype.itemsize})")

    def check(self) -> None:
        """DataError unless the file at ``path`` is still the one opened, whole."""
        try:
            now = FileIdentity.of(os.stat(self.path))
        except OSError as exc:
            raise DataError(f"--data: {self.path!r} went away while the run read it ({exc.strerror}); "
                            "a data file must stay unchanged for the whole run") from None
        if now != self.identity:
            was, new = self.identity, now
            what = (f"{was.size} bytes, now {new.size}" if new.size != was.size else
                    "replaced by another file" if (new.dev, new.ino) != (was.dev, was.ino) else
                    "rewritten in place")
            raise DataError(f"--data: {self.path!r} changed while the run read it ({what}); "
                            "a data file must stay unchanged for the whole run")

    def read(self, start: int, n: int) -> np.ndarray:
        """Ids ``start`` .. ``start + n`` (a private copy, (n,))."""
        size = n * self.dtype.itemsize
        buf = os.pread(self._fd, size, self.offset + start * self.dtype.itemsize)
        if len(buf) != size:
            self.check()   # names what changed; a short read of an unchanged file is still wrong
            raise DataError(f"--data: {self.path!r} ended early: {len(buf)} of {size} bytes at "
                            f"token {start}; a data file must stay unchanged for the whole run")
        return np.frombuffer(buf, dtype=self.dtype)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


@dataclass
class TokenView:
    """Ids ``start`` .. ``stop`` of a :class:`TokenFile`: a split of the stream, never in memory."""

    file: TokenFile
    start: int = 0
    stop: int = -1

    def __post_init__(self) -> None:
        if self.stop < 0:
            self.stop = self.file.count

    @property
    def dtype(self) -> np.dtype:
        return self.file.dtype

    def __len__(self) -> int:
        return self.stop - self.start

    def window(self, at: int, n: int) -> np.ndarray:
        """Ids ``at`` .. ``at + n`` of this view, (n,)."""
        if at < 0 or at + n > len(self):
            raise IndexError(f"window {at}..{at + n} outside 0..{len(self)}")
        return self.file.read(self.start + at, n)

    def split(self, at: int) -> tuple[TokenView, TokenView]:
        return TokenView(self.file, self.start, self.start + at), \
            TokenView(self.file, self.start + at, self.stop)

    def chunks(self, n: int = SCAN_TOKENS) -> Iterator[np.ndarray]:
        for at in range(0, len(self), n):
            yield self.window(at, min(n, len(self) - at))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole view in memory: for small files and tests only."""
        whole = np.concatenate([np.empty(0, self.dtype), *self.chunks()])
        return whole if dtype is None else whole.astype(dtype)


def open_tokens(path: str) -> TokenView:
    """A ``.npy`` file (any 1-D integer array), a ``.bin`` file (uint16, as nanoGPT) or any
    other file read as bytes (uint8, vocabulary 256). ConfigError naming --data if unreadable."""
    p = Path(path)
    try:
        if p.suffix == ".npy":
            with open(p, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(f)
                offset = f.tell()
            if dtype.hasobject:
                raise ConfigError("--data", f"{path!r} holds Python objects; token ids must be an "
                                  "integer array (int or uint)")
            return TokenView(TokenFile(path, dtype=dtype, offset=offset, shape=tuple(shape)))
        size = p.stat().st_size
        if p.suffix == ".bin":
            if size % 2:
                raise ValueError(f"{size} bytes is not a whole number of uint16 ids")
            return TokenView(TokenFile(path, dtype=np.dtype(np.uint16), offset=0, shape=(size // 2,)))
        return TokenView(TokenFile(path, dtype=np.dtype(np.uint8), offset=0, shape=(size,)))
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("--data", f"cannot read {path!r}: {exc}") from None


def id_range(tokens: TokenView) -> tuple[int, int]:
    """(smallest, largest) id, read in chunks of :data:`SCAN_TOKENS`."""
    low, top = None, None
    for part in tokens.chunks():
        lo, hi = int(part.min()), int(part.max())
        low, top = lo if low is None else min(low, lo), hi if top is None else max(top, hi)
    return (0 if low is None else low), (0 if top is None else top)


# ---------------------------------------------------------------- the cache of tokenised text
def fingerprint(path: str) -> str:
    """16 hex digits of the file's size, mtime and the SHA-256 of its first MiB."""
    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(FINGERPRINT_HEAD))
    return h.hexdigest()[:16]


def cache_dir(path: str) -> Path:
    """Beside the text when its directory is writable, else the user's cache directory."""
    here = Path(path).resolve().parent
    if os.access(here, os.W_OK):
        return here
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainmesh"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _npy_header(dtype: np.dtype, count: int) -> bytes:
    """A version 1.0 ``.npy`` header of exactly :data:`NPY_HEADER` bytes for (count,) ids."""
    meta = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                 "shape": (count,)})
    body = meta.ljust(NPY_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


def write_atomic(path: Path, write: Callable) -> None:
    """Write ``path`` through a private temporary file and a rename (readers never see half)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_token_cache(path: Path, dtype: np.dtype, pieces: Iterable[np.ndarray]) -> int:
    """Stream ``pieces`` of ids into the ``.npy`` file ``path`` (atomically); their count."""
    count = 0

    def write(f) -> None:
        nonlocal count
        f.write(_npy_header(dtype, 0))
        for part in pieces:
            f.write(np.ascontiguousarray(part, dtype=dtype).tobytes())
            count += len(part)
        f.seek(0)
        f.write(_npy_header(dtype, count))

    write_atomic(path, write)
    return count
