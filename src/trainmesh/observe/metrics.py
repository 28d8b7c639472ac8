"""Measurements: process memory, bytes held by tensors, and the JSON-lines metrics file."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_now(device: torch.device) -> int:
    """Resident bytes now: CUDA allocated memory, or the process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_kb("VmRSS")


_EARLIER_PEAK: dict[str, int] = {}
"""Per device type: the highest mark before the last :func:`reset_peak` (the process's peak
stays the process's peak across a measurement of one phase)."""


def memory_peak(device: torch.device) -> int:
    """Peak resident bytes: CUDA max allocated, or the process's RSS high-water mark on CPU,
    since the process started (however often :func:`reset_peak` ran)."""
    return max(_EARLIER_PEAK.get(device.type, 0), memory_peak_since_reset(device))


def memory_peak_since_reset(device: torch.device) -> int:
    """Peak resident bytes since the last :func:`reset_peak` (or the process's start)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kb("VmHWM")


def reset_peak(device: torch.device) -> None:
    """Start a new high-water mark (CUDA; on Linux also the RSS mark via clear_refs); the one
    before is kept for :func:`memory_peak`."""
    _EARLIER_PEAK[device.type] = memory_peak(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class MetricsWriter:
    """Appends one JSON object per line (rank 0 writes; other ranks pass path=None)."""

    def __init__(self, path: str | None, *, keep_steps_before: int = 1, append: bool = False,
                 also: Callable[[dict[str, Any]], None] | None = None) -> None:
        """A fresh file; when resuming at step k, the step records before k are kept. ``append``
        keeps every record (an elastic job's attempts: steps recomputed after a restart then
        appear again, the last record of a step is the newest). ``also`` is handed every
        record written (TensorBoard: :meth:`~trainmesh.observe.tensorboard.TensorBoardLog.record`)."""
        self.path = Path(path) if path else None
        self.also = also
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if append:
                return
            kept = []
            if keep_steps_before > 1 and self.path.exists():
                for line in self.path.read_text().splitlines():
                    rec = json.loads(line)
                    if rec.get("event") == "step" and rec["step"] < keep_steps_before:
                        kept.append(line + "\n")
            self.path.write_text("".join(kept))

    def write(self, record: dict[str, Any]) -> None:
        if self.also is not None:
            self.also(record)
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
