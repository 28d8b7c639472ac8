"""Where each microbatch's elements sit in the global batch, for layout-independent randomness.

The engine sets one :class:`~trainmesh.core.randomness.Draws` around every forward and backward
pass of a microbatch (:func:`microbatch_draws`): the run's seed, the steps taken, the global row
of the microbatch's first row (this data-parallel rank's rows start at ``index · rows``, its
microbatches follow one another), the global positions of the rank's tokens (context
parallelism's two zigzag chunks) and the tensor-parallel rank with sequence parallelism's
split. Imports core and context_parallel.
"""
from __future__ import annotations

from typing import Any

import torch

from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.randomness import Draws


def _tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a microbatch (a tensor, a tuple/list or a dict of them)."""
    parts = list(batch.values()) if isinstance(batch, dict) else \
        list(batch) if isinstance(batch, (tuple, list)) else [batch]
    return [t for t in parts if isinstance(t, torch.Tensor)]


def microbatch_draws(microbatches: list, *, seed: int, step: int, share: tuple[int, int],
                     mesh: ParallelMesh, sequence_parallel: bool,
                     device: torch.device) -> list[Draws | None]:
    """One :class:`Draws` per microbatch of this rank (its share of the sequence already cut:
    dim 1 of its tensors), None for one without (batch, seq) tensors."""
    shapes = [next((t.shape for t in _tensors(mb) if t.dim() >= 2), None) for mb in microbatches]
    rows = [0 if shape is None else shape[0] for shape in shapes]
    row0 = share[0] * sum(rows)                # dp rank index x the rank's rows
    cp, cp_index = mesh.size(Group.cp), mesh.index(Group.cp)
    out: list[Draws | None] = []
    for shape, n in zip(shapes, rows):
        if shape is None:
            out.append(None)
            continue
        if cp > 1:
            from trainmesh.context_parallel.partition import zigzag_positions
            positions = zigzag_positions(shape[1], cp_index, cp, device)
        else:
            positions = torch.arange(shape[1], device=device)
        out.append(Draws(seed, step, row0, n, positions, tp_index=mesh.index(Group.tp),
                         tp=mesh.size(Group.tp), sequence_parallel=sequence_parallel))
        row0 += n
    return out
