"""Whole matrices for Muon's Newton-Schulz iteration wherever the layout cuts them.

:class:`~.muon.MuonAdamW` keeps its momentum laid out like the parameters it steps (ZeRO's
flat shards, tensor-parallel shards, offload's host shards) and maps the iteration over whole
matrices through its ``wholes`` attribute (``map(param, tensors, fn)``: ``fn`` of each whole
matrix, the result laid out like ``param``); :class:`~.whole_params.WholeParams` maps a user's
optimizer step the same way. :func:`~.whole_maps.install` sets the map the layout needs:

- **whole along DP** (one process, DDP, pipeline stages, experts on their ep rank, context
  parallelism's replicas): every rank holds each whole gradient, so it runs the iteration on
  its own matrices; handing each matrix to one owner would add a broadcast per matrix to save
  compute only, and the step waits on the slowest rank either way.
- **ZeRO 1-3, HSDP** (:class:`~.zero_owners.ShardOwners`): each matrix has one **owner** in
  the shard group, chosen by balancing the iteration's FLOPs (greedy, largest first, from the
  shapes alone, so every rank computes the same table). The matrices go in buckets (the same
  on every rank): one ``all_to_all`` over the shard group sends each rank's stretches of each
  matrix to its owner, each owner assembles its matrices whole and runs the iteration on them
  while the others run theirs, and a second ``all_to_all`` returns each rank's stretches of the
  results: each element once each way, two collectives per bucket. The transient memory is the
  bucket's.
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
  Per bucket the shard group's all-to-all brings each matrix's tp shards whole to the ZeRO
  owner's TP group (each rank its tp shard), which iterates the bucket's matrices it owns as tp
  owners do (:func:`tp_iterate`: two all-to-alls over tp), and the second all-to-all over the
  shard group returns the stretches: each matrix iterated once per shard group x TP group.
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

__all__ = ["ByName", "Local", "TensorParallel", "TensorParallelOwners", "owners",
           "tp_iterate", "tp_owners"]


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

    def map_many(self, ps: list[torch.Tensor], us: list[torch.Tensor], fn: WholeFn) -> list[torch.Tensor]:
        """``fn`` of each whole ``us[i]`` (laid out like ``ps[i]``), each cut one at its owner;
        the results laid out like ``ps`` (:func:`tp_iterate`)."""
        return tp_iterate(self.tp, [self.names[id(p)] for p in ps], us, self.table, fn)


@torch.no_grad()
def tp_iterate(tp: TensorParallel, names: list[str], us: list[torch.Tensor], table: dict[str, int],
               fn: WholeFn) -> list[torch.Tensor]:
    """``fn`` of each whole parameter ``names[i]`` whose tp shard is ``us[i]`` on every rank of
    the TP group, each cut one at its owner (``table``: tp index) only, the others (uncut:
    whole on every tp rank) right here; this rank's shards of the results. Two all-to-alls
    over tp: the cut matrices' shards to their owners, the results' shards back (in the shards'
    common dtype: exact casts). Every rank of the TP group passes the same names."""
    n = tp.tp
    cut = [i for i, name in enumerate(names) if tp.cut(name) is not None]
    by_owner = [[i for i in cut if table[names[i]] == r] for r in range(n)]
    me = tp.comm.mesh.index(Group.tp)
    mine = by_owner[me]
    sizes = [sum(us[i].numel() for i in owned) for owned in by_owner]
    out: list[torch.Tensor | None] = [None] * len(names)
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
