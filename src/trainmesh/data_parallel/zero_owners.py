"""Whole matrices under ZeRO 1-3 and HSDP: each one iterated at its owner, a bucket at a time.

A ZeRO shard holds stretches of its group's parameters (:mod:`.flat`: chunk ``r`` of every
bucket of the flat layout is rank ``r``'s). Which stretches every rank of the shard group holds
follows from the layout alone, so each rank knows, without asking, what it sends and what it
receives. Per bucket of matrices (consecutive in the group's order, up to the optimizer's
``bucket_values`` whole values: the same buckets on every rank):

1. one ``all_to_all`` over the shard group sends each rank's stretches of each matrix (of every
   tensor mapped: Muon's one update, a user's optimizer's value and gradient) to the matrix's
   owner (:func:`~.muon_owners.owners`), which copies them into its whole matrices;
2. each owner runs ``fn`` on the matrices it owns, all ranks at once (under tp x ZeRO the
   owner's TP group iterates them as tp owners do, :func:`~.muon_owners.tp_iterate`);
3. a second ``all_to_all`` returns each rank's stretches of the results.

So every element crosses once each way (no zero-filled matrix reduced, no whole one
broadcast), a bucket costs two collectives whatever its matrices, and the transient memory is
the bucket's: this rank's stretches, the matrices it owns whole, their results. Every copy is
exact, so the results equal one process's iteration on the same matrices bit for bit.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..comm import Comm
from .flat import FlatLayout, Slot
from .muon import BUCKET_VALUES
from .muon_owners import TensorParallel, WholeFn, owners, tp_iterate, tp_owners

Run = tuple[int, int]
"""(first element of the parameter, element count): a stretch as every rank sees it."""


def layouts_of(sync, gi: int) -> list[FlatLayout]:
    """The flat layouts group ``gi``'s shard is made of, in the shard's order (ZeRO-1/2: one;
    ZeRO-3: one per unit holding a piece of the group)."""
    if hasattr(sync, "_group_pieces"):
        return [pc.layout for pc in sync._group_pieces(gi)]
    return [sync.groups[gi].layout]


def runs_by_rank(layouts: Sequence[FlatLayout], ranks: int) -> list[dict[str, list[Run]]]:
    """Per shard index: each parameter's runs that shard holds, first element first. Chunk
    ``r`` of every bucket of a layout is shard ``r``'s (:mod:`.flat`), so a parameter's
    elements are cut at the chunks' bounds: one pass over the chunks each parameter spans."""
    out: list[dict[str, list[Run]]] = [{} for _ in range(ranks)]
    for layout in layouts:
        for s in layout.slots:
            at = s.start
            while at < s.end:
                bucket, within = divmod(at, layout.bucket_numel)
                r = within // layout.chunk
                stop = min(s.end, bucket * layout.bucket_numel + (r + 1) * layout.chunk)
                out[r].setdefault(s.name, []).append((at - s.start, stop - at))
                at = stop
    return out


def buckets(slots: Sequence[Slot], values: Sequence[int], limit: int) -> list[list[Slot]]:
    """``slots`` cut in order into buckets of at least ``limit`` of ``values`` (the last one
    less; one slot more crosses it)."""
    out: list[list[Slot]] = [[]]
    held = 0
    for slot, v in zip(slots, values):
        if held >= limit:
            out.append([])
            held = 0
        out[-1].append(slot)
        held += v
    return [b for b in out if b]


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
        self.whole_values = {name: math.prod(shape) for name, shape in slots}
        """Each parameter's whole values (over tp too): the buckets' measure, the same on every
        rank of the shard group and of the TP group."""
        self.runs: dict[int, list[dict[str, list[Run]]]] = {gi: self._runs(gi) for gi in whole}
        """Per group, per rank of the shard group: each parameter's runs that rank holds."""

    def _runs(self, gi: int) -> list[dict[str, list[Run]]]:
        out = runs_by_rank(layouts_of(self.sync, gi), len(self.ranks))
        mine: dict[str, list[Run]] = {}
        for s, _, offset, n in self.sync._stretches(gi):
            mine.setdefault(s.name, []).append((offset, n))
        if out[self.me] != mine:          # the geometry as this shard's own stretches say
            raise AssertionError("the flat layouts' geometry differs from this shard's stretches")
        return out

    @torch.no_grad()
    def map(self, p: torch.Tensor, tensors: list[torch.Tensor], fn: WholeFn) -> torch.Tensor:
        """``fn`` of each parameter's whole ``tensors`` (laid out like the shard ``p``) at its
        owner; its result returned to every holder's stretches (laid out like ``p``)."""
        gi = self._group_of(p)
        mine: dict[str, list[tuple[object, int, int]]] = {}
        for slot, index, offset, n in self.sync._stretches(gi):
            mine.setdefault(slot.name, []).append((index, offset, n))
        out = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
        slots = self.sync._slots(gi)
        limit = getattr(self.sync.optimizer, "bucket_values", BUCKET_VALUES)
        for bucket in buckets(slots, [self.whole_values[s.name] for s in slots], limit):
            self._bucket(bucket, self.runs[gi], mine, tensors, fn, out)
        return out

    def _bucket(self, bucket: list[Slot], runs: list[dict[str, list[Run]]],
                mine: dict[str, list[tuple[object, int, int]]], tensors: list[torch.Tensor],
                fn: WholeFn, out: torch.Tensor) -> None:
        """One bucket's three phases (module docstring); this rank's stretches into ``out``."""
        n, me, k = len(self.ranks), self.me, len(tensors)
        dtype, device = out.dtype, out.device
        by_owner = [[s for s in bucket if self.table[s.name] == o] for o in range(n)]
        owned = by_owner[me]

        def held(r: int, slots: list[Slot]) -> int:      # rank r's elements of ``slots``
            return sum(c for s in slots for _, c in runs[r].get(s.name, []))

        # 1. my stretches to their owners; their ranks' stretches of mine to me
        send = [t[index].reshape(-1).to(device, dtype) for o in range(n) for s in by_owner[o]
                for t in tensors for index, _, _ in mine.get(s.name, [])]
        send_t = torch.cat(send) if send else out.new_empty(0)
        got_sizes = [k * held(r, owned) for r in range(n)]
        got = torch.empty(sum(got_sizes), dtype=dtype, device=device)
        self.comm.all_to_all_v(got, send_t, self.axis, out_splits=got_sizes,
                               in_splits=[k * held(me, slots) for slots in by_owner])
        del send, send_t
        wholes = {s.name: torch.empty(k, s.numel, dtype=dtype, device=device) for s in owned}
        for r, block in enumerate(got.split(got_sizes)):
            at = 0
            for s in owned:
                for j in range(k):
                    for offset, c in runs[r].get(s.name, []):
                        wholes[s.name][j, offset : offset + c] = block[at : at + c]
                        at += c
        del got
        # 2. the iteration on the matrices this rank owns
        results = self._iterate(owned, wholes, fn) if owned else []
        del wholes
        # 3. each rank's stretches of the results back
        back = [res[offset : offset + c] for r in range(n) for s, res in zip(owned, results)
                for offset, c in runs[r].get(s.name, [])]
        back_t = torch.cat(back) if back else out.new_empty(0)
        ret_sizes = [held(me, slots) for slots in by_owner]
        ret = torch.empty(sum(ret_sizes), dtype=dtype, device=device)
        self.comm.all_to_all_v(ret, back_t, self.axis, out_splits=ret_sizes,
                               in_splits=[held(r, owned) for r in range(n)])
        del back, back_t, results
        at = 0
        for slots in by_owner:                          # owner o's results, my stretches
            for s in slots:
                for index, _, c in mine.get(s.name, []):
                    out[index] = ret[at : at + c]
                    at += c

    def _iterate(self, owned: list[Slot], wholes: dict[str, torch.Tensor], fn: WholeFn) -> list[torch.Tensor]:
        """``fn`` of each owned parameter's whole tensors; the flat results in their dtype."""
        dtype = next(iter(wholes.values())).dtype
        views = [[w.view(s.shape) for w in wholes[s.name]] for s in owned]
        if self.tp_table:                               # Muon under tp x ZeRO: one tensor each
            names = [s.name for s in owned]
            results = tp_iterate(self.tp, names, [v[0] for v in views], self.tp_table, fn)
        else:                                           # gathered over tp where it cuts them
            results = [self.tp.apply(s.name, v, fn) for s, v in zip(owned, views)]
        return [r.reshape(-1).to(dtype) for r in results]

    def owns(self, name: str) -> bool:
        """Whether this rank is parameter ``name``'s owner (its whole TP group is)."""
        return self.table.get(name) == self.me

    def _group_of(self, p: torch.Tensor) -> int:
        """The group whose shard (or fp32 master of it) ``p`` is."""
        for gi, sp in enumerate(self.sync.optimizer_params()):
            if sp is p:
                return gi
        raise LookupError("the optimizer stepped a tensor that is no shard of this strategy")

