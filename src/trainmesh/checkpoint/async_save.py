"""Checkpoints that do not stall training (``--async-save``): a snapshot, then a background write.

A save has two parts:

* **blocking**, on the main thread of every rank, in the same order everywhere: wait for the
  previous save's write; gather the logical tensors across ranks (the only collectives: the
  same as a synchronous save's); copy the tensors this rank writes to host memory (pinned
  on CUDA); rank 0 creates the hidden ``.step-*.tmp`` directory; a barrier. Training resumes.
* **background**, on one writer thread per rank, with no collective at all: write this rank's
  safetensors file and hash it, then drop a small entry file (file name, sha256, keys) beside
  it. Rank 0's thread waits for every rank's entry, writes the manifest and renames the
  directory into place — the same format, manifest and atomic rename as
  :func:`trainmesh.checkpoint.sharded.save`, so a reader never sees a half-written checkpoint.

The next save waits for the previous write (so at most one is in flight), and the host
buffers of its snapshot are reused: the extra memory is one host copy of this rank's share. At exit the last write is waited for; a worker killed meanwhile
(SIGKILL, Ctrl-C, SIGTERM) leaves only the hidden ``.tmp`` directory, which the next run on
the directory removes: the previous checkpoint stays the newest.

Every save, synchronous or not, yields a :class:`SaveRecord` for the metrics file.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainmesh.checkpoint.sharded import (
    manifest_of,
    pieces,
    publish,
    step_dir,
    write_piece,
)
from trainmesh.comm import Comm
from trainmesh.core.placement import Placements
from trainmesh.data_parallel.base import GradSync

ENTRY = "rank{:05d}.entry.json"
"""A rank's entry in the temporary directory: its file, that file's sha256 and its keys (or
null: nothing to write). Rank 0 folds them into the manifest and removes them."""
POLL_S = 0.01


@dataclass(frozen=True)
class SaveRecord:
    """One save as the metrics file reports it (``{"event": "save", ...}``)."""

    step: int
    blocking_s: float
    """Seconds training stood still for it (the whole save when synchronous)."""
    total_s: float
    """Seconds from its start until the checkpoint was in place."""
    path: str

    def event(self) -> dict[str, Any]:
        return {"event": "save", "step": self.step, "blocking_s": self.blocking_s,
                "total_s": self.total_s, "path": self.path}


def _stage(value: torch.Tensor, buffers: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """``value`` copied into this key's host buffer, reused from save to save (pinned for CUDA
    tensors, so the device-to-host copy is a DMA): after the first save, a snapshot is one
    memory copy, without allocating (page faults cost as much as the copy)."""
    value = value.detach()
    buf = buffers.get(key)
    if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
        buf = buffers[key] = torch.empty(value.shape, dtype=value.dtype,
                                         pin_memory=value.device.type == "cuda")
    buf.copy_(value, non_blocking=value.device.type == "cuda")
    return buf


def _write_entry(tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """This rank's file, then its entry (renamed into place: whole or absent)."""
    part = tmp / (ENTRY.format(rank) + ".part")
    part.write_text(json.dumps(write_piece(tmp, rank, tensors)))
    os.replace(part, tmp / ENTRY.format(rank))


def _publish(tmp: Path, final: Path, world: int, header: dict[str, Any], timeout_s: float) -> None:
    """Rank 0: wait for every rank's entry, then publish as a synchronous save does."""
    names = [tmp / ENTRY.format(r) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in names):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(names) if not p.exists()]
            raise TimeoutError(f"async save of {final.name}: ranks {missing} did not finish "
                               f"writing within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    entries = [json.loads(p.read_text()) for p in names]
    for p in names:
        p.unlink()
    publish(tmp, final, manifest_of(entries, **header))


class AsyncSaver:
    """Snapshots on the main thread, writes on a background thread; one write in flight."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list[SaveRecord] = []
        self._lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}
        """Host copies of this rank's share, reused by every save (one write in flight)."""

    def save(self, root: str | Path, grad_sync: GradSync, comm: Comm, *, step: int,
             layout: dict[str, Any], trainer_state: dict[str, Any],
             placements: Placements | None = None,
             untrained: Sequence[tuple[str, torch.Tensor]] = ()) -> float:
        """Collective, as :func:`trainmesh.checkpoint.sharded.save` (whose arguments it takes; ``comm``
        is this saver's): snapshot the state as checkpoint ``step`` under ``root`` and start
        its write. Returns the blocking seconds (waiting for the previous write included)."""
        assert comm is self.comm, "an AsyncSaver saves over the comm layer it was made with"
        started = time.perf_counter()
        self.wait()
        comm, mesh = self.comm, self.comm.mesh
        root = Path(root)
        final = step_dir(root, step)
        tmp = root / f".{final.name}.tmp"
        mine = pieces(grad_sync, comm, placements or Placements(),   # collectives: same order
                      lambda key, t: _stage(t, self._buffers, key), untrained)
        if any(t.is_pinned() for t in mine.values()):
            torch.cuda.synchronize()   # the non-blocking device-to-host copies have landed
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        comm.barrier()
        header = {"step": step, "layout": layout, "trainer": trainer_state}
        blocking = time.perf_counter() - started
        self._thread = threading.Thread(
            target=self._write, name=f"trainmesh-save-{step}", daemon=True,
            args=(tmp, final, mine, header, started, blocking))
        self._thread.start()
        return blocking

    def _write(self, tmp: Path, final: Path, mine: dict[str, torch.Tensor],
               header: dict[str, Any], started: float, blocking: float) -> None:
        mesh = self.comm.mesh
        try:
            _write_entry(tmp, mesh.rank, mine)
            if mesh.rank == 0:
                _publish(tmp, final, mesh.world_size, header, self.comm.timeout_s)
            record = SaveRecord(header["step"], blocking, time.perf_counter() - started, str(final))
            with self._lock:
                self._done.append(record)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; re-raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"rank {self.comm.mesh.rank}: background checkpoint write "
                               f"failed: {error}") from error

    def finished(self) -> list[SaveRecord]:
        """The saves whose write completed since the last call (main thread)."""
        with self._lock:
            done, self._done = self._done, []
        return done
