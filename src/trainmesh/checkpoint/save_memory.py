"""What a save costs in memory, per rank: the save event's ``peak_added_bytes`` beside the
rank's own state (``held_bytes``) and its staging buffer (``staging_bytes``)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainmesh.checkpoint.chunks import Chunks
from trainmesh.data_parallel.base import GradSync
from trainmesh.observe.metrics import memory_now, memory_peak_since_reset, reset_peak, storage_bytes


class SavePeak:
    """The memory a save adds on this rank: its high-water mark over what it held before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before = 0
        self.added = 0

    def __enter__(self) -> "SavePeak":
        reset_peak(self.device)
        self.before = memory_now(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.added = max(0, memory_peak_since_reset(self.device) - self.before)


def held_bytes(grad_sync: GradSync, untrained: Sequence[tuple[str, torch.Tensor]]) -> int:
    """This rank's own model and optimizer state (what a save writes of it), in bytes."""
    held = grad_sync.held_tensors()
    return storage_bytes([*held["params"], *held["optimizer"], *(t for _, t in untrained)])


def largest_chunk(state: dict[str, Any]) -> int:
    """The staging buffer of a synchronous save: its largest chunk (written one at a time)."""
    sizes = [t.numel() * t.element_size() for v in state.values() if isinstance(v, Chunks)
             for t in v.pieces.values()]
    return max(sizes, default=0)


def memory_record(ranks: list[dict[str, int]]) -> dict[str, Any]:
    """The save event's memory fields from every rank's measurement."""
    return {"peak_added_bytes": max(r["peak_added_bytes"] for r in ranks), "memory": ranks}
