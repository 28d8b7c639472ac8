"""Where each parameter's values live across the mesh: one typed record per parameter name.

A :class:`Placement` says which part of its logical (tp=1) tensor a parameter holds on this
rank, how its gradient must be completed, and whether the rank counts it in the global norm:

* ``tp_dim`` / ``tp_start`` / ``tp_parts``: a tensor-parallel shard is the slice
  ``[tp_start, tp_start + width)`` along ``tp_dim`` of the full tensor (``full_shape``) — or, for
  a fused projection of ``tp_parts`` equal blocks (GPT-2's ``[q | k | v]``), that slice of each
  block, concatenated. ``tp_dim`` None: replicated over tp.
* ``partial_grad``: sequence parallelism leaves each TP rank with the gradient of its sequence
  chunk only (norm weights, row-parallel biases); the engine sums these over tp after backward.
* ``duplicate``: a pipeline tie's copy on a rank other than the lowest one (counted once).
* ``expert``: an MoE expert's parameter under expert parallelism: held only by the ranks of one
  ``ep`` index, its gradient reduced over ``edp``, written to checkpoints by one of those ranks.
* ``ep_dim`` / ``ep_start``: experts stacked in one tensor (a Hugging Face ``(E, ...)``
  ``gate_up_proj``) split over ``ep`` along their expert dimension: this rank holds
  ``[ep_start, ep_start + width)`` of it; a checkpoint gathers the whole tensor over ``ep``.

Which groups each kind of parameter is reduced, sharded and held over is the axis table's
(:mod:`trainmesh.core.axes`, ``KINDS``; :meth:`Placements.kind` names a parameter's kind).

:class:`Placements`, keyed by the parameter's name in the whole model, is owned by the engine:
tensor parallelism records shards and partial gradients, the pipeline marks duplicates,
sharded initialisation and checkpoints read it. Being keyed by name, a record survives the
parameter object being replaced (sharded initialisation swaps meta tensors for real ones).
A parameter without a record is whole and replicated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """How one parameter is laid out across the mesh (see the module docstring)."""

    full_shape: tuple[int, ...]
    """Shape of the logical, unsharded tensor."""
    tp_dim: int | None = None
    """Dimension of the full tensor split over tp; None: replicated over tp."""
    tp_start: int = 0
    """First index this rank holds along ``tp_dim`` (of each block when ``tp_parts`` > 1)."""
    tp_parts: int | tuple[int, ...] = 1
    """Blocks of ``tp_dim`` each split separately: a count of equal blocks (3: a fused
    ``[q | k | v]``) or the blocks' sizes in the full tensor (grouped-query q, k, v)."""
    partial_grad: bool = False
    """Sequence parallel: this rank's gradient covers its sequence chunk; summed over tp."""
    duplicate: bool = False
    """A pipeline tie's copy whose gradient another rank already counts in the norm."""
    expert: bool = False
    """An expert's parameter spread by expert parallelism (held by one ``ep`` index's ranks)."""
    ep_dim: int | None = None
    """Dimension of stacked experts split over ep (their expert dimension); None: not split."""
    ep_start: int = 0
    """First index this rank holds along ``ep_dim``."""

    def __post_init__(self) -> None:
        parts = self.tp_parts
        if (parts < 1) if isinstance(parts, int) else (not parts or min(parts) < 1):
            raise ValueError(f"tp_parts must be >= 1 or positive block sizes, got {parts}")
        for name, dim in (("tp_dim", self.tp_dim), ("ep_dim", self.ep_dim)):
            if dim is not None and not 0 <= dim < len(self.full_shape):
                raise ValueError(f"{name} {dim} outside full shape {self.full_shape}")
        if self.ep_dim is not None and self.ep_dim == self.tp_dim:
            raise ValueError(f"ep_dim and tp_dim are both {self.ep_dim}: split different dimensions")

    @property
    def sharded(self) -> bool:
        """Whether the parameter is a tensor-parallel shard (counted on every TP rank)."""
        return self.tp_dim is not None

    def pieces(self, local_shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
        """Indices into the full tensor whose concatenation along ``tp_dim`` is this rank's
        ``local_shape`` tensor: one index, or one per block of a fused projection."""
        whole = [slice(0, n) for n in self.full_shape]
        if self.ep_dim is not None:                     # this rank's run of stacked experts
            whole[self.ep_dim] = slice(self.ep_start, self.ep_start + local_shape[self.ep_dim])
        if self.tp_dim is None:
            return [tuple(whole)]
        dim, parts, total = self.tp_dim, self.tp_parts, self.full_shape[self.tp_dim]
        blocks = [total // parts] * parts if isinstance(parts, int) else list(parts)
        n = total // local_shape[dim]                   # the TP degree
        rank = self.tp_start // (blocks[0] // n)
        out, offset = [], 0
        for block in blocks:                            # a fused projection: one slice per block
            width = block // n
            index = list(whole)
            index[dim] = slice(offset + rank * width, offset + (rank + 1) * width)
            out.append(tuple(index))
            offset += block
        return out


class Placements:
    """The records of one model's parameters, by name (a name without one: whole, replicated)."""

    def __init__(self) -> None:
        self._records: dict[str, Placement] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._records))

    def get(self, name: str) -> Placement | None:
        """The record of ``name``, or None (whole and replicated)."""
        return self._records.get(name)

    def record(self, name: str, placement: Placement) -> None:
        """Set the record of ``name``."""
        self._records[name] = placement

    def mark(self, name: str, shape: tuple[int, ...], **changes: bool) -> None:
        """Set flags (``partial_grad``, ``duplicate``) on the record of ``name``, creating a
        replicated one of full shape ``shape`` when it has none."""
        current = self._records.get(name) or Placement(full_shape=tuple(shape))
        self._records[name] = dataclasses.replace(current, **changes)

    def add_prefix(self, prefix: str, other: "Placements") -> None:
        """Take ``other``'s records, their names under module ``prefix`` ("" for the root)."""
        for name in other:
            self._records[f"{prefix}.{name}" if prefix else name] = other._records[name]

    def sharded(self, name: str) -> bool:
        record = self._records.get(name)
        return record is not None and record.sharded

    def ep_split(self, name: str) -> bool:
        """Whether ``name`` is a tensor of stacked experts split over ep along ``ep_dim``."""
        record = self._records.get(name)
        return record is not None and record.ep_dim is not None

    def expert(self, name: str) -> bool:
        """Whether ``name`` is an expert's parameter under expert parallelism."""
        record = self._records.get(name)
        return record is not None and record.expert

    def kind(self, name: str) -> str:
        """The axis table's kind of ``name`` (:data:`trainmesh.core.axes.KINDS`): "expert" or
        "dense"; it says which groups reduce, shard and hold the parameter."""
        return "expert" if self.expert(name) else "dense"

    def partial_grad_names(self) -> list[str]:
        """Names whose gradient is partial over tp, sorted (the same order on every rank)."""
        return sorted(n for n, r in self._records.items() if r.partial_grad)
