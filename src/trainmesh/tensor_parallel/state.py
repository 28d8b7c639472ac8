"""Between shards and full tensors: what a checkpoint, the engine or a parity check needs of a
TP model, given its :class:`~trainmesh.core.placement.Placements`.

A sharded parameter's record has ``tp_dim``, the dimension of the full tensor it is the
``rank``-th of ``n`` equal slices of; anything else is replicated over tp. A fused projection's
record also has ``tp_parts`` = P: the full dimension is P equal blocks (GPT-2's [q | k | v]),
and the shard is the ``rank``-th slice of each block, concatenated.
"""
from __future__ import annotations

import torch
from torch import nn

from trainmesh.core.placement import Placement, Placements

from ..comm import Comm
from .mappings import _gather


def shard_dim(placement: Placement | None) -> int | None:
    """The dimension a parameter so placed is split along over tp, or None if replicated."""
    return placement.tp_dim if placement is not None else None


def shard_parts(placement: Placement | None) -> int | tuple[int, ...]:
    """The blocks the sharded dimension is split in: a count of equal blocks (1: one plain
    slice) or the block sizes of the full tensor (a fused q, k, v of unequal sizes)."""
    return placement.tp_parts if placement is not None else 1


def part_sizes(total: int, parts: int | tuple[int, ...]) -> list[int]:
    """The block sizes of a dimension of ``total`` elements split in ``parts``."""
    return [total // parts] * parts if isinstance(parts, int) else list(parts)


def shard_of(full: torch.Tensor, dim: int | None, rank: int, n: int,
             parts: int | tuple[int, ...] = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` (the whole tensor when ``dim`` is None);
    several ``parts``: its slice of each block along ``dim``, concatenated."""
    if dim is None:
        return full
    if parts != 1:   # (.., ΣL, ..) -> blocks (.., L_j, ..) -> (.., ΣL_j/n, ..)
        blocks = full.split(part_sizes(full.shape[dim], parts), dim)
        return torch.cat([shard_of(b, dim, rank, n) for b in blocks], dim)
    width = full.shape[dim] // n
    return full.narrow(dim, rank * width, width)


@torch.no_grad()
def full_tensor(p: torch.Tensor, comm: Comm, axis: str = "tp", *,
                placement: Placement | None = None) -> torch.Tensor:
    """The unsharded value of ``p`` (an all-gather over tp for a shard; a copy otherwise).
    ``placement``: the record of the parameter ``p`` is (or shares the sharding of, e.g. its
    Adam moment); None: replicated."""
    dim = shard_dim(placement)
    if dim is None or p.dim() == 0:
        return p.detach().clone()
    gathered = _gather(p.detach().contiguous(), dim, comm, axis)      # rank-major
    parts = shard_parts(placement)
    if parts == 1:
        return gathered
    n = comm.mesh.size(axis)
    local = [size // n for size in part_sizes(gathered.shape[dim], parts)]
    ranks = [r.split(local, dim) for r in gathered.chunk(n, dim)]
    return torch.cat([torch.cat([r[j] for r in ranks], dim) for j in range(len(local))], dim)  # block-major


def full_state_dict(module: nn.Module, comm: Comm, placements: Placements,
                    axis: str = "tp") -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` unsharded, under its tp=1 name, on every rank;
    a tied parameter under each of its names (gathered once)."""
    out = {name: full_tensor(p, comm, axis, placement=placements.get(name))
           for name, p in module.named_parameters()}
    first = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(name, out[first[id(p)]])
    out.update({name: b.detach().clone() for name, b in module.named_buffers()})
    return out


@torch.no_grad()
def sum_partial_grads(grads: list[torch.Tensor], comm: Comm, axis: str = "tp") -> None:
    """Sequence parallelism: sum ``grads`` (each TP rank's part of the same parameters'
    gradients, in the same order on every rank) over ``axis``, in place, as one flat
    all-reduce."""
    grads = [g for g in grads if g.numel()]
    if not grads or comm.mesh.size(axis) == 1:
        return
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])   # (sum of numels,)
    comm.all_reduce(flat, axis)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sum_partial_grads_of(module: nn.Module, placements: Placements, comm: Comm,
                         axis: str = "tp") -> None:
    """:func:`sum_partial_grads` on the ``.grad`` of ``module``'s partial-gradient parameters
    (a TP model used without the engine, after its backward)."""
    params = dict(module.named_parameters())
    sum_partial_grads([params[n].grad for n in placements.partial_grad_names()
                       if n in params and params[n].grad is not None], comm, axis)
