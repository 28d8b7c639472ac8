"""ZeRO-Infinity's NVMe tier: optimizer states and fp32 masters in one file per rank.

Between steps the optimizer's state tensors (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``:
every state shaped like its parameter; scalar step counters stay in memory) and the fp32
masters that are copies of the parameters live only in the file: the host holds an empty
placeholder in their place. A step runs group by group with double buffering on one background
I/O thread::

    read(0)
    for g in groups:   wait read(g); read(g + 1) in the background;
                       step g; copy its masters back; write(g) in the background
    wait for the writes

Each tensor has a fixed stretch of the file (given on its first write), read and written whole
with ``os.preadv`` / ``os.pwrite`` straight from and into the tensor's memory (large blocks, no
extra copy). The file is removed when the store is collected or the process exits cleanly, and
the directory too when the store made it (no ``--offload-dir``). A full disk mid-run raises
:class:`OffloadError` naming the rank: the store never writes under ``--save-dir``, so the newest
checkpoint is intact.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainmesh.core.errors import ConfigError

ALIGN = 64
"""Byte alignment of each tensor's stretch of the file."""
FAULT_ENV = "TRAINMESH_FAULT_NVME_ENOSPC_AFTER"
"""Tests only: after this many writes the store fails as a full disk would (ENOSPC)."""

Key = tuple[int, str]            # (id of the parameter, state key or "param")


class OffloadError(RuntimeError):
    """The NVMe store could not write (e.g. the disk is full)."""


@dataclass(frozen=True)
class _Slot:
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def _remove(fd: int, path: Path, own_dir: Path | None) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    path.unlink(missing_ok=True)
    if own_dir is not None:
        shutil.rmtree(own_dir, ignore_errors=True)


def check_space(directory: str | None, needed: int) -> None:
    """Refuse (``--offload-dir``) a directory whose file system has less than ``needed`` bytes
    free: the optimizer states and masters the local ranks will write."""
    path = Path(directory) if directory else Path(tempfile.gettempdir())
    base = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(base).free
    if free < needed:
        raise ConfigError("--offload-dir", f"{str(path)!r} has {free / 1e9:.3f} GB free; --offload "
                          f"nvme writes {needed / 1e9:.3f} GB of optimizer states here: give a "
                          "directory on a file system with room")


class NvmeStore:
    """One rank's optimizer states and separate masters in a file under ``directory``."""

    def __init__(self, directory: str | None, *, rank: int) -> None:
        self.rank = rank
        own = None
        if directory is None:
            own = Path(tempfile.mkdtemp(prefix="trainmesh-offload-"))
            directory = str(own)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"optim-rank{rank}-{os.getpid()}.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._finalizer = weakref.finalize(self, _remove, self.fd, self.path, own)
        self.slots: dict[Key, _Slot] = {}
        self.end = 0
        self.params: dict[int, torch.nn.Parameter] = {}   # separate masters, swapped out too
        self.out: set[Key] = set()                         # what lives only in the file now
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nvme-rank{rank}")
        fault = os.environ.get(FAULT_ENV)
        self._writes_left = int(fault) if fault else None

    # ---------------------------------------------------------------- tensors of a group
    def register(self, masters: list[torch.nn.Parameter]) -> None:
        """``masters`` are copies of the parameters: swap them out with the states (now)."""
        for m in masters:
            self.params[id(m)] = m
        for f in [self._write_async(k, t) for k, t in self._take([{"params": masters}], None)]:
            f.result()

    def _take(self, groups: list[dict], optimizer: torch.optim.Optimizer | None
              ) -> list[tuple[Key, torch.Tensor]]:
        """Swap out: the groups' masters and full-size states, each replaced by a placeholder."""
        out = []
        for group in groups:
            for p in group["params"]:
                shape = p.shape
                if id(p) in self.params and (id(p), "param") not in self.out:
                    out.append(((id(p), "param"), p.data))
                    p.data = torch.empty(0, dtype=p.dtype)
                state = optimizer.state.get(p, {}) if optimizer is not None else {}
                for k, v in state.items():
                    if torch.is_tensor(v) and v.shape == shape and (id(p), k) not in self.out:
                        out.append(((id(p), k), v))
                        state[k] = torch.empty(0, dtype=v.dtype)
        self.out.update(k for k, _ in out)
        return out

    def _keys(self, groups: list[dict]) -> list[Key]:
        """What of ``groups`` lives only in the file, in file order (sequential reads)."""
        ids = {id(p) for g in groups for p in g["params"]}
        return sorted((k for k in self.out if k[0] in ids), key=lambda k: self.slots[k].offset)

    def _put(self, loaded: list[tuple[Key, torch.Tensor]], groups: list[dict],
             optimizer: torch.optim.Optimizer) -> None:
        """Swap in: put tensors read from the file back in their places."""
        by_id = {id(p): p for g in groups for p in g["params"]}
        for (pid, k), t in loaded:
            if k == "param":
                by_id[pid].data = t
            else:
                optimizer.state[by_id[pid]][k] = t
            self.out.discard((pid, k))

    # ---------------------------------------------------------------- file I/O
    def _read(self, keys: list[Key]) -> list[tuple[Key, torch.Tensor]]:
        out = []
        for key in keys:
            slot = self.slots[key]
            t = torch.empty(slot.shape, dtype=slot.dtype)
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            done = 0
            while done < slot.nbytes:
                n = os.preadv(self.fd, [view[done:]], slot.offset + done)
                if n <= 0:
                    raise OffloadError(f"rank {self.rank}: {self.path} is shorter than expected")
                done += n
            out.append((key, t))
        return out

    def _write(self, slot: _Slot, t: torch.Tensor) -> None:
        view = memoryview(t.view(-1).view(torch.uint8).numpy())
        try:
            if self._writes_left is not None:
                if self._writes_left <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self._writes_left -= 1
            done = 0
            while done < slot.nbytes:
                done += os.pwrite(self.fd, view[done:], slot.offset + done)
        except OSError as e:
            raise OffloadError(f"rank {self.rank}: --offload nvme could not write {slot.nbytes} "
                               f"bytes of optimizer state to {self.path}: {e.strerror or e} (the "
                               "run stops; checkpoints under --save-dir are untouched by the "
                               "offload store, the newest one is intact)") from e

    def _write_async(self, key: Key, t: torch.Tensor) -> Future:
        """Write ``t`` to its stretch of the file (given now, on its first write) in the background."""
        t = t.detach().contiguous()
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _Slot(self.end, t.shape, t.dtype)
            self.end += -(-slot.nbytes // ALIGN) * ALIGN
        return self._io.submit(self._write, slot, t)

    # ---------------------------------------------------------------- the store's seam
    def step(self, optimizer: torch.optim.Optimizer, before_group: Any, after_group: Any,
             run: Any) -> None:
        """Step the optimizer group by group (``run(optimizer)`` with only that group in it),
        the next group read while this one updates."""
        groups = list(optimizer.param_groups)
        reading = self._io.submit(self._read, self._keys(groups[:1]))
        writes: list[Future] = []
        try:
            for i, group in enumerate(groups):
                self._put(reading.result(), [group], optimizer)
                before_group(group)
                if i + 1 < len(groups):
                    reading = self._io.submit(self._read, self._keys(groups[i + 1 : i + 2]))
                optimizer.param_groups = [group]
                try:
                    run(optimizer)
                finally:
                    optimizer.param_groups = groups
                after_group(group)
                writes += [self._write_async(k, t) for k, t in self._take([group], optimizer)]
        finally:
            for f in writes:
                f.result()

    @contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        groups = list(optimizer.param_groups)
        self._put(self._read(self._keys(groups)), groups, optimizer)
        try:
            yield
        finally:
            for f in [self._write_async(k, t) for k, t in self._take(groups, optimizer)]:
                f.result()

    def file_bytes(self) -> int:
        """Size of this rank's file, from the file system."""
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        """Remove the file (and the directory the store made)."""
        self._io.shutdown(wait=True)
        self._finalizer()
