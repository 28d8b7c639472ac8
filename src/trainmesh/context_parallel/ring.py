"""Attention over a sequence split over the CP group: ring (K/V blocks passed rank to rank) or
all-gather (K/V gathered once per layer), forward and backward.

Each rank holds its two zigzag chunks (:mod:`.partition`) of q, k, v: (b, h, 2c, hd). For each
source rank j of K/V, the pairs (query chunk, key chunk) are attended by chunk index: a key
chunk before the query chunk fully, the same chunk with the causal (diagonal) mask, a later
one not at all (skipped, never computed). Partial results merge by log-sum-exp (:mod:`.blocks`).

Ring, forward (n = cp ranks, rank r): step t = 0..n-1 attends the K/V of rank (r - t) mod n
while the next block travels: the send to rank r+1 and the receive from r-1 are issued
(batched isend/irecv) before the step's compute and waited for after it; n-1 hops.

Ring, backward: the K/V blocks travel the ring again (n-1 hops) and with each, the gradient
accumulators dK/dV of its source: each rank adds the contribution of its queries and passes
them on; after n hops they are back with their owner. K/V travel in the compute dtype, dK/dV in
float32 (or float64).

All-gather: one all-gather of every rank's K/V per layer in forward (kept for backward), and in
backward one reduce-scatter of the dK/dV contributions to their owners.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from trainmesh.comm import Comm
from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh

from .blocks import attend_block, attend_block_backward, merge
from .documents import GatheredDocuments, Piece, plan_of
from .partition import chunk_ids

MODES = ("ring", "allgather")


class Ring(Protocol):
    """How CP ranks exchange blocks (a real group: :class:`CommRing`; tests emulate one)."""

    size: int
    index: int

    def shift(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Send ``t`` to the next rank, receive the previous rank's; returns the wait."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """(size, *t.shape): every rank's ``t`` in rank order."""
        ...

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (size, *shape) of every rank summed; this rank's row."""
        ...


class CommRing:
    """The CP group of ``mesh`` through the accounted communication layer (axis ``cp``)."""

    def __init__(self, comm: Comm, mesh: ParallelMesh) -> None:
        self.comm = comm
        ranks = mesh.ranks(Group.cp)
        self.size, self.index = len(ranks), mesh.index(Group.cp)
        self.next, self.prev = ranks[(self.index + 1) % self.size], ranks[(self.index - 1) % self.size]

    def shift(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        t = t.contiguous()
        buf = torch.empty_like(t)
        handles = self.comm.batch_p2p([("send", t, self.next), ("recv", buf, self.prev)], axis=Group.cp)

        def wait() -> torch.Tensor:
            for h in handles:
                h.wait()
            return buf
        return wait

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()            # gathered along dim 0, as the backends want it
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        self.comm.all_gather(out, t, Group.cp)
        return out.view(self.size, *t.shape)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().flatten(0, 1)
        out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        self.comm.reduce_scatter(out, t, Group.cp)
        return out


class _Acc:
    """The merged (out, lse) of one query chunk, built piece by piece (a piece may cover some
    rows and positions of the chunk only; those it does not cover stay out 0, lse -inf)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, p: Piece, o: torch.Tensor, lse: torch.Tensor, like: torch.Tensor) -> None:
        whole = p.rows == slice(None) and p.q.start == 0 and p.q.stop == like.shape[2]
        if self.out is None and whole:
            self.out, self.lse = o, lse
            return
        if self.out is None or self.lse is None:
            self.out = torch.zeros(like.shape, dtype=o.dtype, device=o.device)
            self.lse = torch.full(like.shape[:-1], float("-inf"), dtype=lse.dtype, device=o.device)
        if whole:
            self.out, self.lse = merge(self.out, self.lse, o, lse)
            return
        out, new_lse = merge(self.out[p.rows, :, p.q], self.lse[p.rows, :, p.q], o, lse)
        self.out[p.rows, :, p.q], self.lse[p.rows, :, p.q] = out, new_lse


def _cut(t: torch.Tensor, rows: slice, pos: slice) -> torch.Tensor:
    """Rows and positions (dim 2) of a (b, h, c, hd) chunk, contiguous for the kernels."""
    if rows == slice(None) and pos.start == 0 and pos.stop == t.shape[2]:
        return t
    return t[rows, :, pos].contiguous()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, mode: str, fused: bool, pieces, keep):  # type: ignore[override]
        n, me = ring.size, ring.index
        qs = q.chunk(2, dim=2)
        c = q.shape[2] // 2
        acc = [_Acc(), _Acc()]

        groups = q.shape[1] // k.shape[1]                   # grouped-query: q heads per k/v head

        def attend(kv: torch.Tensor, src: int) -> None:
            ks, vs = (_repeat(t, groups).chunk(2, dim=2) for t in kv)
            for (a, j, b), ps in pieces.items():
                if j != src:
                    continue
                for p in ps:
                    o, lse = attend_block(_cut(qs[a], p.rows, p.q), _cut(ks[b], p.rows, p.k),
                                          _cut(vs[b], p.rows, p.k), causal=p.kind == "causal",
                                          fused=fused, mask=p.mask,
                                          keep=_keep(keep, p, (me, a), (src, b), c, n, q.device))
                    acc[a].add(p, o, lse, qs[a])

        kv = torch.stack([k, v])                            # (2, b, h, 2c, hd)
        every = None
        with torch.autocast(q.device.type, enabled=False):
            if mode == "ring":
                for t in range(n):
                    wait = ring.shift(kv) if t < n - 1 else None   # overlapped with this block
                    attend(kv, (me - t) % n)
                    if wait is not None:
                        kv = wait()
            else:
                every = ring.all_gather(kv)                 # (n, 2, b, h, 2c, hd)
                for j in range(n):
                    attend(every[j], j)
        out = torch.cat([acc[0].out, acc[1].out], dim=2).to(q.dtype)   # type: ignore[list-item]
        lse = torch.cat([acc[0].lse, acc[1].lse], dim=2)               # type: ignore[list-item]
        if mode == "ring":
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            ctx.save_for_backward(q, k, v, out, lse, every)
        ctx.ring, ctx.mode, ctx.fused, ctx.pieces, ctx.keep = ring, mode, fused, pieces, keep
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, *rest = ctx.saved_tensors
        ring, fused, pieces, keep = ctx.ring, ctx.fused, ctx.pieces, ctx.keep
        n, me = ring.size, ring.index
        qs, dos, outs, lses = (t.chunk(2, dim=2) for t in (q, dout, out, lse))
        acc_dtype = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dqs = dq.chunk(2, dim=2)
        c = q.shape[2] // 2
        groups = q.shape[1] // k.shape[1]

        def contributions(kv: torch.Tensor, src: int) -> torch.Tensor:
            """dK/dV (2, b, h_kv, 2c, hd) of source ``src``'s block from this rank's queries."""
            ks, vs = (_repeat(t, groups).chunk(2, dim=2) for t in kv)
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            for (a, j, b), ps in pieces.items():
                if j != src:
                    continue
                for p in ps:
                    gq, gk, gv = attend_block_backward(
                        _cut(dos[a], p.rows, p.q), _cut(qs[a], p.rows, p.q),
                        _cut(ks[b], p.rows, p.k), _cut(vs[b], p.rows, p.k),
                        _cut(outs[a], p.rows, p.q), _cut(lses[a].unsqueeze(-1), p.rows, p.q)[..., 0],
                        causal=p.kind == "causal", fused=fused, mask=p.mask,
                        keep=_keep(keep, p, (me, a), (src, b), c, n, q.device))
                    dqs[a][p.rows, :, p.q] += gq
                    keys = slice(b * c + p.k.start, b * c + p.k.stop)
                    dkv[0][p.rows, :, keys] += _sum_groups(gk, groups)
                    dkv[1][p.rows, :, keys] += _sum_groups(gv, groups)
            return dkv

        if ctx.mode == "ring":
            kv = torch.stack([k, v])
            incoming = None
            for t in range(n):
                wait_kv = ring.shift(kv) if t < n - 1 else None
                dkv = contributions(kv, (me - t) % n)
                if incoming is not None:
                    dkv += incoming()                     # the accumulator of the same source
                incoming = ring.shift(dkv)                # on to the next rank (the n-th hop: home)
                if wait_kv is not None:
                    kv = wait_kv()
            dkv = incoming()                              # type: ignore[misc]
        else:
            every = rest[0]
            dkv = ring.reduce_scatter(torch.stack([contributions(every[j], j) for j in range(n)]))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


Keep = Callable[[slice, torch.Tensor, torch.Tensor], torch.Tensor]
"""Attention dropout: ``keep(rows, q_positions, k_positions)`` -> the scaled keep mask
(rows, h, cq, ck) of those rows of the micro-batch and those global positions."""


def _keep(keep: Keep | None, p: Piece, query: tuple[int, int], key: tuple[int, int], c: int,
          n: int, device: torch.device) -> torch.Tensor | None:
    """A piece's keep mask: its query positions in chunk ``query`` = (rank, 0 or 1) and key
    positions in chunk ``key``, as global positions (chunk id · c + position in the chunk)."""
    if keep is None:
        return None
    q0 = chunk_ids(query[0], n)[query[1]] * c
    k0 = chunk_ids(key[0], n)[key[1]] * c
    qpos = torch.arange(q0 + p.q.start, q0 + p.q.stop, device=device)
    kpos = torch.arange(k0 + p.k.start, k0 + p.k.stop, device=device)
    return keep(p.rows, qpos, kpos)


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each k/v head serves ``groups`` query heads in a row,
    (b, h_kv, c, hd) -> (b, h_kv·groups, c, hd)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(g: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_repeat`: (b, h_kv·groups, c, hd) -> (b, h_kv, c, hd)."""
    if groups == 1:
        return g
    b, h, c, hd = g.shape
    return g.view(b, h // groups, groups, c, hd).sum(2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *,
                   mode: str = "ring", fused: bool = False, documents: torch.Tensor | None = None,
                   window: int | None = None, keep: Keep | None = None,
                   plans: GatheredDocuments | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag chunks of q (b, h, 2c, hd) and k, v (b, h_kv, 2c,
    hd; grouped-query attention when h_kv < h: each k/v head serves h / h_kv query heads in a
    row, and travels the ring once) over the whole sequence held by the ``ring``'s ranks;
    -> (b, h, 2c, hd). ``mode``: ``ring`` or ``allgather``; ``fused``: per-block fused kernels
    (:func:`~.blocks.fused_available`); ``documents``: (b or 1, s) document id of every
    position of the whole rows, the same on every rank (:func:`~.documents.gather_documents`):
    attention stays within a document; ``window``: a query attends the keys less than
    ``window`` positions back (a sliding window); ``keep``: attention dropout (:data:`Keep`),
    every block then on the math path; ``plans``: the :class:`~.documents.GatheredDocuments`
    that gave ``documents``, which keeps their plan of blocks for the forward's other layers
    (None: planned here). Blocks with no attended pair are skipped (:mod:`.documents`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape and a head count dividing q's; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"a CP rank holds two equal chunks of the sequence; got length {q.shape[2]}")
    if documents is not None and (documents.shape[-1] != q.shape[2] * ring.size
                                  or documents.shape[0] not in (1, q.shape[0])):
        raise ValueError(f"documents must be (batch or 1, {q.shape[2] * ring.size}); got "
                         f"{tuple(documents.shape)}")
    c = q.shape[2] // 2       # one document per row is planned as none: the plain causal ring
    pieces = (plans.plan if plans is not None else plan_of)(documents, ring.index, ring.size, c, window)
    return _Attention.apply(q, k, v, ring, mode, fused and keep is None, pieces, keep)
