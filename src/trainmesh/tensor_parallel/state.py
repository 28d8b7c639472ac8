"""Between shards and full tensors: what a checkpoint or a parity check needs of a TP model.

A sharded parameter carries ``_tm_tp_dim``, the dimension of the full tensor it is the
``rank``-th of ``n`` equal slices of; anything else is replicated over tp. A fused projection's
shard also carries ``_tm_tp_parts`` = P: the full dimension is P equal blocks (GPT-2's [q | k | v]),
and the shard is the ``rank``-th slice of each block, concatenated.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from .mappings import _gather


def shard_dim(t: torch.Tensor) -> int | None:
    """The dimension ``t`` is split along over tp, or None if it is replicated."""
    return getattr(t, "_tm_tp_dim", None) if getattr(t, "_tm_tp_sharded", False) else None


def shard_parts(t: torch.Tensor) -> int | tuple[int, ...]:
    """The blocks the sharded dimension of ``t`` is split in: a count of equal blocks (1: one
    plain slice) or the block sizes of the full tensor (a fused q, k, v of unequal sizes)."""
    return getattr(t, "_tm_tp_parts", 1)


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
                like: torch.Tensor | None = None) -> torch.Tensor:
    """The unsharded value of ``p`` (an all-gather over tp for a shard; a copy otherwise).
    ``like``: the parameter whose sharding ``p`` shares (e.g. ``p`` is its Adam moment)."""
    dim = shard_dim(p if like is None else like)
    if dim is None or p.dim() == 0:
        return p.detach().clone()
    gathered = _gather(p.detach().contiguous(), dim, comm, axis)      # rank-major
    parts = shard_parts(p if like is None else like)
    if parts == 1:
        return gathered
    n = comm.mesh.size(axis)
    local = [size // n for size in part_sizes(gathered.shape[dim], parts)]
    ranks = [r.split(local, dim) for r in gathered.chunk(n, dim)]
    return torch.cat([torch.cat([r[j] for r in ranks], dim) for j in range(len(local))], dim)  # block-major


def full_state_dict(module: nn.Module, comm: Comm, axis: str = "tp") -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` unsharded, under its tp=1 name, on every rank;
    a tied parameter under each of its names (gathered once)."""
    out = {name: full_tensor(p, comm, axis) for name, p in module.named_parameters()}
    first = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(name, out[first[id(p)]])
    out.update({name: b.detach().clone() for name, b in module.named_buffers()})
    return out
