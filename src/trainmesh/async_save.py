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
  :func:`trainmesh.checkpoint.save`, so a reader never sees a half-written checkpoint.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import FORMAT, MANIFEST, _sha256, _writer, step_dir
from .comm import Comm
from .data_parallel.base import GradSync
from .tensor_parallel.state import full_tensor, shard_dim

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


def snapshot(grad_sync: GradSync, comm: Comm, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collective over dp and tp: host copies (in ``buffers``) of the logical tensors this rank
    writes (the checkpoint's keys and writers). Tensors sharded over tp are gathered on every
    rank, in the same order as :func:`trainmesh.checkpoint.save` does; the others are copied
    only by their writer."""
    mesh = comm.mesh
    me = mesh.index("dp") * mesh.size("tp") + mesh.index("tp")
    params, optim = grad_sync.logical_state()
    by_name = dict(grad_sync.named_params)
    mine: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        like = by_name[name]
        items = [(f"param/{name}", t), *((f"optim/{name}/{k}", v) for k, v in optim.get(name, {}).items())]
        for key, value in items:
            writes = _writer(key, comm) == me
            if shard_dim(like) is not None and value.dim() > 0:
                value = full_tensor(value, comm, like=like)   # collective over tp
            if writes:
                mine[key] = _stage(value, buffers, key)
    if any(t.is_pinned() for t in mine.values()):
        torch.cuda.synchronize()   # the non-blocking device-to-host copies have landed
    return mine


def _write_piece(tmp: Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    """This rank's file, then its entry (renamed into place: whole or absent)."""
    from safetensors.torch import save_file
    entry = None
    if tensors:
        path = tmp / f"rank{rank:05d}.safetensors"
        save_file(tensors, str(path))
        entry = {"file": path.name, "sha256": _sha256(path), "keys": sorted(tensors)}
    part = tmp / (ENTRY.format(rank) + ".part")
    part.write_text(json.dumps(entry))
    os.replace(part, tmp / ENTRY.format(rank))


def _publish(tmp: Path, final: Path, world: int, header: dict[str, Any], timeout_s: float) -> None:
    """Rank 0: wait for every rank's entry, write the manifest, rename ``tmp`` to ``final``."""
    names = [tmp / ENTRY.format(r) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in names):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(names) if not p.exists()]
            raise TimeoutError(f"async save of {final.name}: ranks {missing} did not finish "
                               f"writing within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    entries = [json.loads(p.read_text()) for p in names]
    manifest = {"format": FORMAT, **header,
                "files": {e["file"]: e["sha256"] for e in entries if e},
                "tensors": {k: e["file"] for e in entries if e for k in e["keys"]}}
    with (tmp / MANIFEST).open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for p in names:
        p.unlink()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)          # atomic: the checkpoint appears whole or not at all


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

    def save(self, root: str | Path, grad_sync: GradSync, *, step: int, layout: dict[str, Any],
             trainer_state: dict[str, Any]) -> float:
        """Collective: snapshot the state as checkpoint ``step`` under ``root`` and start its
        write. Returns the blocking seconds (waiting for the previous write included)."""
        started = time.perf_counter()
        self.wait()
        comm, mesh = self.comm, self.comm.mesh
        root = Path(root)
        final = step_dir(root, step)
        tmp = root / f".{final.name}.tmp"
        mine = snapshot(grad_sync, comm, self._buffers)   # collectives: same order on every rank
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
            _write_piece(tmp, mesh.rank, mine)
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
