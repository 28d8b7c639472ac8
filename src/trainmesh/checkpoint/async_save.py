"""Checkpoints that do not stall training (``--async-save``): a snapshot, then a background write.

A save has two parts:

* **blocking**, on the main thread of every rank, in the same order everywhere: wait for the
  previous save's write; copy the chunks this rank holds (:mod:`.local_state`: its own shards,
  never a gathered tensor) to host buffers (pinned on CUDA); plan the write (DCP's local and
  global plans: two small object gathers, the only collectives); rank 0 creates the hidden
  ``.step-*.tmp`` directory. Training resumes.
* **background**, on one writer thread per rank, with no collective at all: write this rank's
  ``.distcp`` file and hash it, then drop a small entry file (its write results and sha256)
  beside it. Rank 0's thread waits for every rank's entry, writes ``.metadata`` and the
  manifest and renames the directory into place — the same format and atomic rename as
  :func:`trainmesh.checkpoint.sharded.save`, so a reader never sees a half-written checkpoint.

The next save waits for the previous write (so at most one is in flight), and the host
buffers of its snapshot are reused: the extra memory is one host copy of this rank's own
shards. At exit the last write is waited for; a worker killed meanwhile (SIGKILL, Ctrl-C,
SIGTERM) leaves only the hidden ``.tmp`` directory, which the next run on the directory
removes: the previous checkpoint stays the newest.

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

from trainmesh.checkpoint.chunks import Chunks
from trainmesh.checkpoint.dcp_io import METADATA, PlannedSave, results_from_json, results_to_json
from trainmesh.checkpoint.local_state import save_state
from trainmesh.checkpoint.save_memory import SavePeak, held_bytes, memory_record
from trainmesh.checkpoint.sharded import FORMAT, publish, step_dir
from trainmesh.comm import Comm
from trainmesh.core.placement import Placements
from trainmesh.data_parallel.base import GradSync

ENTRY = "rank{:05d}.entry.json"
"""A rank's entry in the temporary directory: its DCP write results and its files' sha256.
Rank 0 folds them into ``.metadata`` and the manifest and removes them."""
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
    memory: dict[str, Any] | None = None
    """What the save added to memory (:func:`trainmesh.checkpoint.sharded.memory_record`):
    ``peak_added_bytes`` (the most over ranks) and per rank ``memory``."""

    def event(self) -> dict[str, Any]:
        return {"event": "save", "step": self.step, "blocking_s": self.blocking_s,
                "total_s": self.total_s, "path": self.path, **(self.memory or {})}


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


def _staged(state: dict[str, Any], buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``state`` with every tensor and chunk copied into this rank's host buffers."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Chunks):
            copy = out[key] = Chunks(value.global_size, value.dtype)
            for offs, t in value.pieces.items():
                copy.add(offs, _stage(t, buffers, f"{key}@{offs}"))
        elif torch.is_tensor(value):
            out[key] = _stage(value, buffers, key)
        else:
            out[key] = value
    return out


def _write_entry(tmp: Path, rank: int, planned: PlannedSave) -> None:
    """This rank's file, then its entry (renamed into place: whole or absent)."""
    results, files = planned.write()
    part = tmp / (ENTRY.format(rank) + ".part")
    part.write_text(json.dumps({"results": results_to_json(results), "files": files}))
    os.replace(part, tmp / ENTRY.format(rank))


def _publish(tmp: Path, final: Path, world: int, planned: PlannedSave, header: dict[str, Any],
             timeout_s: float) -> None:
    """Rank 0: wait for every rank's entry, then finish and publish as a synchronous save does."""
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
    files = {name: digest for e in entries for name, digest in e["files"].items()}
    files[METADATA] = planned.finish([results_from_json(e["results"]) for e in entries])
    publish(tmp, final, {"format": FORMAT, **header, "files": files})


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
             untrained: Sequence[tuple[str, torch.Tensor]] = (),
             measure: dict[str, Any] | None = None) -> float:
        """Collective, as :func:`trainmesh.checkpoint.sharded.save` (whose arguments it takes; ``comm``
        is this saver's; the memory measured comes with the record): snapshot the state as
        checkpoint ``step`` under ``root`` and start its write. Returns the blocking seconds
        (waiting for the previous write included)."""
        assert comm is self.comm, "an AsyncSaver saves over the comm layer it was made with"
        started = time.perf_counter()
        self.wait()
        comm, mesh = self.comm, self.comm.mesh
        root = Path(root)
        final = step_dir(root, step)
        tmp = root / f".{final.name}.tmp"
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        comm.barrier()
        with SavePeak(grad_sync.device) as peak:
            with save_state(grad_sync, comm, placements or Placements(), untrained,
                            trainer_state.get("tied")) as state:
                staged = _staged(state, self._buffers)     # this rank's own chunks only
            if any(t.is_pinned() for t in self._buffers.values()):
                torch.cuda.synchronize()   # the non-blocking device-to-host copies have landed
            planned = PlannedSave(staged, tmp, comm, staging_parts=None)   # two object gathers
        mine = {"rank": mesh.rank, "peak_added_bytes": peak.added,
                "held_bytes": held_bytes(grad_sync, untrained),
                "staging_bytes": sum(t.numel() * t.element_size() for t in self._buffers.values())}
        memory = memory_record(comm.all_gather_object(mine))
        header = {"step": step, "layout": layout, "trainer": trainer_state}
        blocking = time.perf_counter() - started
        self._thread = threading.Thread(
            target=self._write, name=f"trainmesh-save-{step}", daemon=True,
            args=(tmp, final, planned, header, started, blocking, memory))
        self._thread.start()
        return blocking

    def _write(self, tmp: Path, final: Path, planned: PlannedSave, header: dict[str, Any],
               started: float, blocking: float, memory: dict[str, Any]) -> None:
        mesh = self.comm.mesh
        try:
            _write_entry(tmp, mesh.rank, planned)
            if mesh.rank == 0:
                _publish(tmp, final, mesh.world_size, planned, header, self.comm.timeout_s)
            record = SaveRecord(header["step"], blocking, time.perf_counter() - started,
                                str(final), memory)
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
