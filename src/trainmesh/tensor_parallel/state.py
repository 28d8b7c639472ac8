"""Between shards and full tensors: what a checkpoint or a parity check needs of a TP model.

A sharded parameter carries ``_tm_tp_dim``, the dimension of the full tensor it is the
``rank``-th of ``n`` equal slices of; anything else is replicated over tp.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from .mappings import _gather


def shard_dim(t: torch.Tensor) -> int | None:
    """The dimension ``t`` is split along over tp, or None if it is replicated."""
    return getattr(t, "_tm_tp_dim", None) if getattr(t, "_tm_tp_sharded", False) else None


def shard_of(full: torch.Tensor, dim: int | None, rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` (the whole tensor when ``dim`` is None)."""
    if dim is None:
        return full
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
    return _gather(p.detach().contiguous(), dim, comm, axis)


def full_state_dict(module: nn.Module, comm: Comm, axis: str = "tp") -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` unsharded, under its tp=1 name, on every rank."""
    out = {name: full_tensor(p, comm, axis) for name, p in module.named_parameters()}
    out.update({name: b.detach().clone() for name, b in module.named_buffers()})
    return out
