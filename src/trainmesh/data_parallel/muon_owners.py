"""Whole matrices for Muon's Newton-Schulz iteration wherever the layout cuts them.

:class:`~.muon.MuonAdamW` keeps its momentum laid out like the parameters it steps (ZeRO's
flat shards, tensor-parallel shards, offload's host shards) and maps the iteration over whole
matrices through its ``wholes`` attribute (``map(param, tensors, fn)``: ``fn`` of each whole
matrix, the result laid out like ``param``); :class:`~.whole_params.WholeParams` maps a user's
optimizer step the same way. :func:`install` sets the map the layout needs:

- **whole along DP** (one process, DDP, pipeline stages, experts on their ep rank, context
  parallelism's replicas): every rank holds each whole gradient, so it runs the iteration on
  its own matrices; handing each matrix to one owner would add a broadcast per matrix to save
  compute only, and the step waits on the slowest rank either way.
- **ZeRO 1-3, HSDP** (:class:`ShardOwners`): each matrix has one **owner** in the shard group,
  chosen by balancing the iteration's FLOPs (greedy, largest first, from the shapes alone, so
  every rank computes the same table). Per matrix, each rank fills its stretches of ``u`` into a
  zeroed matrix and the group reduces it to the owner (a sum of disjoint pieces: exact), the owner
  runs the iteration and broadcasts the result, and each rank copies its stretches back. The
  transient memory is one matrix, not the model.
- **tensor parallelism**: the matrix is gathered over tp (one all-gather) and orthogonalised
  whole, and each TP rank keeps its slice. Distributing the iteration over tp instead would cost
  a collective in every one of its 5 steps (the gram matrix's all-reduce) to save one gather.
  Under ZeRO only the owner's TP group gathers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from trainmesh.core.layout import Group
from trainmesh.core.placement import Placements

from ..comm import Comm
from .base import GradSync
from .muon import Local, ns_flops

Stretch = tuple[object, int, int]
"""(index into the shard, first element of the parameter it holds, element count)."""


def owners(shapes: Sequence[tuple[str, tuple[int, ...]]], ranks: int) -> dict[str, int]:
    """Each matrix's owner among ``ranks``, balancing the iteration's FLOPs: largest first
    (ties in the given order), each to the least loaded rank (ties: the lowest)."""
    load = [0] * ranks
    out: dict[str, int] = {}
    order = sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i][1]), i))
    for i in order:
        r = min(range(ranks), key=lambda k: (load[k], k))
        out[shapes[i][0]] = r
        load[r] += ns_flops(shapes[i][1])
    return out


WholeFn = Callable[[str | None, list[torch.Tensor]], torch.Tensor]
"""(parameter name or None, whole tensors of one parameter) -> a whole tensor of its shape."""

__all__ = ["ByName", "Local", "ShardOwners", "TensorParallel", "install", "owners"]


class TensorParallel:
    """A parameter's tp shard -> its whole value over tp, and back (:class:`Placements`)."""

    def __init__(self, comm: Comm, placements: Placements | None) -> None:
        self.comm = comm
        self.placements = placements
        self.tp = comm.mesh.size(Group.tp)

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        pl = self.placements.get(name) if self.placements is not None else None
        return pl.full_shape if pl is not None and pl.tp_dim is not None else local

    def apply(self, name: str, tensors: list[torch.Tensor], fn: WholeFn) -> torch.Tensor:
        """``fn`` of the whole parameters whose tp shards are ``tensors``; this rank's shard of
        its result (one all-gather over tp per tensor)."""
        pl = self.placements.get(name) if self.placements is not None else None
        if pl is None or pl.tp_dim is None or self.tp == 1:
            return fn(name, tensors)
        local = tuple(tensors[0].shape)
        whole = fn(name, [self._gather(pl, t) for t in tensors])
        return torch.cat([whole[idx] for idx in pl.pieces(local)], dim=pl.tp_dim)

    def _gather(self, pl, t: torch.Tensor) -> torch.Tensor:
        n, dim, local = self.tp, pl.tp_dim, tuple(t.shape)
        gathered = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
        self.comm.all_gather(gathered, t.contiguous().view(-1), Group.tp)
        gathered = gathered.view(n, *local)
        full = torch.zeros(pl.full_shape, dtype=t.dtype, device=t.device)
        width0 = pl.pieces(local)[0][dim]
        step = width0.stop - width0.start
        for r in range(n):
            at = dataclasses.replace(pl, tp_start=r * step)
            _scatter_pieces(full, gathered[r], at.pieces(local), dim)
        return full


class ByName:
    """Whole along DP, cut over tp: each parameter gathered over tp by its name."""

    def __init__(self, sync: GradSync, tp: TensorParallel) -> None:
        self.tp = tp
        self.names: dict[int, str] = {id(p): n for n, p in sync.named_params}
        if sync.master is not None:
            self.names.update({id(m): n for m, (n, _) in zip(sync.master.masters, sync.named_params)})

    def map(self, p: torch.Tensor, tensors: list[torch.Tensor], fn: WholeFn) -> torch.Tensor:
        return self.tp.apply(self.names[id(p)], tensors, fn)

    def owns(self, name: str) -> bool:
        """Every rank steps each parameter it holds."""
        return True


def _scatter_pieces(full: torch.Tensor, local: torch.Tensor, pieces: list, dim: int) -> None:
    at = 0
    for idx in pieces:
        w = idx[dim].stop - idx[dim].start
        full[idx] = local.narrow(dim, at, w)
        at += w


class ShardOwners:
    """Under ZeRO: each parameter whole at its owner rank of the shard group (module docstring)."""

    def __init__(self, sync, tp: TensorParallel) -> None:
        self.sync, self.tp = sync, tp
        self.comm: Comm = sync.comm
        self.axis = sync.axis
        self.ranks = self.comm.mesh.ranks(self.axis)
        self.me = self.comm.mesh.index(self.axis)
        # built now, while the optimizer holds every group (a file store steps one at a time)
        whole = [gi for gi, g in enumerate(sync.optimizer.param_groups) if g.get("muon") or g.get("whole")]
        slots = [(s.name, tp.full_shape(s.name, tuple(s.shape))) for gi in whole for s in sync._slots(gi)]
        self.table = owners(slots, len(self.ranks))
        """Each parameter's owner (index in the shard group), from the shapes alone."""

    @torch.no_grad()
    def map(self, p: torch.Tensor, tensors: list[torch.Tensor], fn: WholeFn) -> torch.Tensor:
        """``fn`` of each parameter's whole ``tensors`` (laid out like the shard ``p``) at its
        owner; its result returned to every holder's stretches (laid out like ``p``)."""
        gi = self._group_of(p)
        table = self.table
        mine: dict[str, list[Stretch]] = {}
        for slot, index, offset, n in self.sync._stretches(gi):
            mine.setdefault(slot.name, []).append((index, offset, n))
        k = len(tensors)
        out = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        for slot in self.sync._slots(gi):            # the same order on every rank
            owner = table[slot.name]
            full = torch.zeros(k, slot.numel, dtype=p.dtype, device=p.device)   # one reduce for all
            for index, offset, n in mine.get(slot.name, []):
                for j, t in enumerate(tensors):
                    full[j, offset : offset + n] = t[index]
            self.comm.reduce(full, self.axis, dst=self.ranks[owner])
            if owner == self.me:
                views = [full[j].view(slot.shape) for j in range(k)]
                result = self.tp.apply(slot.name, views, fn)
                full = result.reshape(-1).to(full.dtype).contiguous()
            else:
                full = full[0]
            self.comm.broadcast(full, self.axis, src=self.ranks[owner])
            for index, offset, n in mine.get(slot.name, []):
                out[index] = full[offset : offset + n]
        return out

    def owns(self, name: str) -> bool:
        """Whether this rank is parameter ``name``'s owner (its whole TP group is)."""
        return self.table.get(name) == self.me

    def _group_of(self, p: torch.Tensor) -> int:
        """The group whose shard (or fp32 master of it) ``p`` is."""
        for gi, sp in enumerate(self.sync.optimizer_params()):
            if sp is p:
                return gi
        raise LookupError("the optimizer stepped a tensor that is no shard of this strategy")


def install(sync: GradSync, comm: Comm, placements: Placements | None) -> None:
    """Give every optimizer that declares ``needs_whole_params`` (and takes a ``wholes`` map:
    :class:`~.muon.MuonAdamW`, :class:`~.muon.WholeParams`) the map its part of the layout
    needs (module docstring)."""
    from .composite import CompositeSync
    from .sharded import ShardedSync
    parts = sync.parts if isinstance(sync, CompositeSync) else [sync]
    tp = TensorParallel(comm, placements)
    for part in parts:
        opt = part.optimizer
        if opt is None or not getattr(opt, "needs_whole_params", False) or not hasattr(opt, "wholes"):
            continue
        if isinstance(part, ShardedSync):
            opt.wholes = ShardOwners(part, tp)
        elif tp.tp > 1 or hasattr(opt, "whole_state"):   # a user's optimizer: states by name
            opt.wholes = ByName(part, tp)
