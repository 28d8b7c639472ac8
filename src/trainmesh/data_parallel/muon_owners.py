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
- **tensor parallelism** (:class:`TensorParallelOwners`, Muon): each matrix cut over tp has
  one **owner** among the tp ranks, chosen as ZeRO's (:func:`owners` over tp, the cut matrices'
  whole shapes). The step runs in three phases over a bucket of a group's matrices
  (:data:`~.muon.BUCKET_VALUES`, the same buckets on every tp rank): one ``all_to_all`` over tp
  sends each rank's shards of the cut matrices to their owners, each rank runs the iteration
  on the matrices it owns (and on the ones tp does not cut, which every rank holds whole), and
  a second ``all_to_all`` returns the results' shards. So every matrix is iterated once per TP
  group, the ranks iterate different matrices at the same time, and a bucket costs two
  collectives whatever its matrices; the transient memory is the bucket's (a few times
  BUCKET_VALUES values). Distributing
  one matrix's iteration over tp instead would cost a collective in every one of its 5 steps
  (the gram matrix's all-reduce). A user's optimizer (:class:`ByName`) steps each parameter on
  every tp rank of the gathered whole: its states live where it steps.
- **tp x ZeRO**: the two owner tables compose. ZeRO's owner of each matrix is chosen over the
  shard group from the whole shapes, as without tp; then, among that owner's TP group, each cut
  matrix it owns gets a tp owner, balanced over tp among those matrices (:func:`tp_owners`).
  Per matrix the shard group reduces it to the ZeRO owner's TP group (each rank its tp shard),
  the tp owner gathers it over tp, iterates, scatters it back, and the ZeRO owner broadcasts it
  over the shard group: each matrix iterated once per shard group x TP group.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from trainmesh.core.layout import Group
from trainmesh.core.placement import Placements

from ..comm import Comm
from .base import GradSync
from .muon import Local, MuonAdamW, ns_flops

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


def tp_owners(shapes: Sequence[tuple[str, tuple[int, ...]]], zero_owner: dict[str, int],
              tp: int) -> dict[str, int]:
    """Under tp x ZeRO: each cut matrix's owner among its ZeRO owner's tp ranks, balanced by
    FLOPs over tp among the matrices that ZeRO owner holds (:func:`owners` per ZeRO owner)."""
    out: dict[str, int] = {}
    for owner in sorted(set(zero_owner[name] for name, _ in shapes)):
        out.update(owners([(n, s) for n, s in shapes if zero_owner[n] == owner], tp))
    return out


WholeFn = Callable[[str | None, list[torch.Tensor]], torch.Tensor]
"""(parameter name or None, whole tensors of one parameter) -> a whole tensor of its shape."""

__all__ = ["ByName", "Local", "ShardOwners", "TensorParallel", "TensorParallelOwners", "install",
           "owners", "tp_owners"]


class TensorParallel:
    """A parameter's tp shard -> its whole value over tp, and back (:class:`Placements`)."""

    def __init__(self, comm: Comm, placements: Placements | None) -> None:
        self.comm = comm
        self.placements = placements
        self.tp = comm.mesh.size(Group.tp)

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        pl = self.placements.get(name) if self.placements is not None else None
        return pl.full_shape if pl is not None and pl.tp_dim is not None else local

    def cut(self, name: str):
        """Parameter ``name``'s placement where tp cuts it (tp > 1), else None."""
        pl = self.placements.get(name) if self.placements is not None else None
        return pl if pl is not None and pl.tp_dim is not None and self.tp > 1 else None

    def apply(self, name: str, tensors: list[torch.Tensor], fn: WholeFn) -> torch.Tensor:
        """``fn`` of the whole parameters whose tp shards are ``tensors`` on every tp rank; this
        rank's shard of its result (one all-gather over tp per tensor)."""
        pl = self.cut(name)
        if pl is None:
            return fn(name, tensors)
        local = tuple(tensors[0].shape)
        whole = fn(name, [self._gather(pl, t) for t in tensors])
        return torch.cat([whole[idx] for idx in pl.pieces(local)], dim=pl.tp_dim)

    def apply_at(self, name: str, tensors: list[torch.Tensor], fn: WholeFn, owner: int) -> torch.Tensor:
        """``fn`` of the whole parameters run at tp index ``owner`` only (a gather to it per
        tensor, a scatter of the result); this rank's shard of the result, in ``tensors``' dtype."""
        pl = self.cut(name)
        if pl is None:
            return fn(name, tensors)
        wholes = [self.gather_to(pl, t, owner) for t in tensors]
        result = fn(name, wholes) if wholes[0] is not None else None
        return self.scatter_from(pl, result, owner, tensors[0])

    def gather_to(self, pl, t: torch.Tensor, owner: int) -> torch.Tensor | None:
        """The whole tensor of the tp shards ``t`` at tp index ``owner``; None elsewhere."""
        t = t.contiguous()
        mine = self.comm.mesh.index(Group.tp) == owner
        chunks = [torch.empty_like(t) for _ in range(self.tp)] if mine else None
        self.comm.gather(t, chunks, Group.tp, dst=self.comm.mesh.ranks(Group.tp)[owner])
        return self._assemble(pl, chunks) if chunks is not None else None

    def scatter_from(self, pl, whole: torch.Tensor | None, owner: int, like: torch.Tensor) -> torch.Tensor:
        """This rank's shard (shaped and typed as ``like``) of ``whole``, held at tp index ``owner``."""
        local = tuple(like.shape)
        out = torch.empty(local, dtype=like.dtype, device=like.device)
        chunks = None if whole is None else \
            [self._shard(pl, whole, r, local).to(like.dtype).contiguous() for r in range(self.tp)]
        self.comm.scatter(out, chunks, Group.tp, src=self.comm.mesh.ranks(Group.tp)[owner])
        return out

    def _gather(self, pl, t: torch.Tensor) -> torch.Tensor:
        n, local = self.tp, tuple(t.shape)
        gathered = torch.empty(n * t.numel(), dtype=t.dtype, device=t.device)
        self.comm.all_gather(gathered, t.contiguous().view(-1), Group.tp)
        return self._assemble(pl, list(gathered.view(n, *local)))

    def _at(self, pl, r: int, local: tuple[int, ...]):
        """``pl`` as tp index ``r`` holds it."""
        width0 = pl.pieces(local)[0][pl.tp_dim]
        return dataclasses.replace(pl, tp_start=r * (width0.stop - width0.start))

    def _assemble(self, pl, shards: list[torch.Tensor]) -> torch.Tensor:
        local = tuple(shards[0].shape)
        full = torch.zeros(pl.full_shape, dtype=shards[0].dtype, device=shards[0].device)
        for r, shard in enumerate(shards):
            _scatter_pieces(full, shard, self._at(pl, r, local).pieces(local), pl.tp_dim)
        return full

    def _shard(self, pl, whole: torch.Tensor, r: int, local: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([whole[idx] for idx in self._at(pl, r, local).pieces(local)], dim=pl.tp_dim)


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


class TensorParallelOwners(ByName):
    """Muon where tp cuts matrices (no ZeRO): each cut matrix iterated at its tp owner only,
    a bucket of a group's matrices in three phases (module docstring)."""

    def __init__(self, sync: GradSync, tp: TensorParallel) -> None:
        super().__init__(sync, tp)
        opt = sync.optimizer
        cut = [(self.names[id(p)], self.tp.cut(self.names[id(p)]).full_shape)
               for g in opt.param_groups if g.get("muon") for p in g["params"]
               if self.tp.cut(self.names[id(p)]) is not None]
        self.table = owners(cut, tp.tp)
        """Each cut matrix's owner (tp index), from the shapes alone: the same on every rank."""

    @torch.no_grad()
    def map_many(self, ps: list[torch.Tensor], us: list[torch.Tensor], fn: WholeFn) -> list[torch.Tensor]:
        """``fn`` of each whole ``us[i]`` (laid out like ``ps[i]``), each cut one at its owner;
        the results laid out like ``ps``. Two all-to-alls over tp: the cut matrices' shards to
        their owners, the results' shards back (in the shards' common dtype: exact casts)."""
        tp, n = self.tp, self.tp.tp
        names = [self.names[id(p)] for p in ps]
        cut = [i for i, name in enumerate(names) if tp.cut(name) is not None]
        by_owner = [[i for i in cut if self.table[names[i]] == r] for r in range(n)]
        me = tp.comm.mesh.index(Group.tp)
        mine = by_owner[me]
        sizes = [sum(us[i].numel() for i in owned) for owned in by_owner]
        out: list[torch.Tensor | None] = [None] * len(ps)
        if cut:
            send = torch.cat([us[i].reshape(-1) for owned in by_owner for i in owned])
            dtype = send.dtype                             # the same on every rank
            got = torch.empty(n * sizes[me], dtype=dtype, device=send.device)
            tp.comm.all_to_all_v(got, send, Group.tp, out_splits=[sizes[me]] * n, in_splits=sizes)
            del send
            blocks = got.split(sizes[me])                  # rank r's shards of my matrices
            results, at = [], 0
            for i in mine:
                local, pl = tuple(us[i].shape), tp.cut(names[i])
                whole = tp._assemble(pl, [b[at : at + us[i].numel()].view(local) for b in blocks])
                results.append(fn(names[i], [whole]))
                at += us[i].numel()
            del got, blocks
            back = torch.cat([tp._shard(tp.cut(names[i]), res, r, tuple(us[i].shape)).reshape(-1)
                              .to(dtype) for r in range(n) for i, res in zip(mine, results)]
                             or [us[cut[0]].new_empty(0, dtype=dtype)])
            del results
            ret = torch.empty(sum(sizes), dtype=dtype, device=back.device)
            tp.comm.all_to_all_v(ret, back, Group.tp, out_splits=sizes, in_splits=[sizes[me]] * n)
            at = 0
            for owned in by_owner:                         # owner r's results, my shards
                for i in owned:
                    out[i] = ret[at : at + us[i].numel()].view(us[i].shape)
                    at += us[i].numel()
        for i, name in enumerate(names):                   # uncut: every rank holds it whole
            if out[i] is None:
                out[i] = fn(name, [us[i]])
        return out  # type: ignore[return-value]


def _scatter_pieces(full: torch.Tensor, local: torch.Tensor, pieces: list, dim: int) -> None:
    at = 0
    for idx in pieces:
        w = idx[dim].stop - idx[dim].start
        full[idx] = local.narrow(dim, at, w)
        at += w


class ShardOwners:
    """Under ZeRO: each parameter whole at its owner rank of the shard group (module docstring)."""

    def __init__(self, sync, tp: TensorParallel, *, tp_owned: bool = False) -> None:
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
        cut = [(name, shape) for name, shape in slots if tp.cut(name) is not None]
        self.tp_table = tp_owners(cut, self.table, tp.tp) if tp_owned else {}
        """Muon's: each cut matrix's owner among its ZeRO owner's tp ranks (empty: the whole TP
        group steps it, as a user's optimizer keeping states by name needs)."""

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
                tp_owner = self.tp_table.get(slot.name)
                result = (self.tp.apply(slot.name, views, fn) if tp_owner is None
                          else self.tp.apply_at(slot.name, views, fn, tp_owner))
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
        muon = isinstance(opt, MuonAdamW)
        if isinstance(part, ShardedSync):
            opt.wholes = ShardOwners(part, tp, tp_owned=muon)
        elif tp.tp > 1 and muon:
            opt.wholes = TensorParallelOwners(part, tp)
        elif tp.tp > 1 or hasattr(opt, "whole_state"):   # a user's optimizer: states by name
            opt.wholes = ByName(part, tp)
