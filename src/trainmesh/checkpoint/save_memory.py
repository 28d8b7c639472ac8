"""What a save costs in memory, per rank: the save event's ``peak_added_bytes`` beside the
rank's own state (``held_bytes``) and its staging buffer (``staging_bytes``)."""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import io
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

from trainmesh.data_parallel.base import GradSync
from trainmesh.observe.metrics import memory_now, memory_peak_since_reset, reset_peak, storage_bytes


@cache
def libraries_ready() -> None:
    """Once per process: the first use of what a save runs (OpenSSL's SHA-256, torch's zip
    writer) maps about 2 MiB of their shared code and initialises them; done here, before the
    first save is measured, it counts with the process, as importing them does."""
    hashlib.sha256(bytes(1 << 16)).hexdigest()
    torch.save(torch.zeros(1), io.BytesIO())


@cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc), so that the RSS a measurement
    starts from is what the process uses: otherwise a save's allocations land in pages freed
    earlier (a step's activations) and the RSS mark does not see them."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class SavePeak:
    """The memory a save adds on this rank: its high-water mark over what it held before (on
    CPU the RSS, from the heap's free pages released: :func:`release_free_heap`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before = 0
        self.added = 0

    def __enter__(self) -> "SavePeak":
        libraries_ready()
        if self.device.type == "cpu":
            release_free_heap()
        reset_peak(self.device)
        self.before = memory_now(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.added = max(0, memory_peak_since_reset(self.device) - self.before)


def held_bytes(grad_sync: GradSync, untrained: Sequence[tuple[str, torch.Tensor]]) -> int:
    """This rank's own model and optimizer state (what a save writes of it), in bytes."""
    held = grad_sync.held_tensors()
    return storage_bytes([*held["params"], *held["optimizer"], *(t for _, t in untrained)])


def memory_record(ranks: list[dict[str, int]]) -> dict[str, Any]:
    """The save event's memory fields from every rank's measurement."""
    return {"peak_added_bytes": max(r["peak_added_bytes"] for r in ranks), "memory": ranks}
