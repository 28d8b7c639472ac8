"""Flat, padded buffers of parameters (or gradients) and this rank's shard of them.

A :class:`FlatLayout` places parameters one after another in a 1-D buffer, pads it, and cuts
it into ``n_buckets`` equal buckets of ``world * chunk`` elements. Rank ``r`` owns chunk ``r``
of every bucket, so each bucket is reduce-scattered or all-gathered *in place* (the rank's
chunk is both the collective's output and a slice of its input), and the rank's shard of any
flat tensor laid out this way is one strided view, no copy::

    flat:    | bucket 0: r0 r1 | bucket 1: r0 r1 | bucket 2: r0 r1 |     (world 2)
    shard(r1) = flat.view(3, 2, chunk)[:, 1]                            # (n_buckets, chunk)

gloo has no uneven all_gather, so padding makes every chunk the same size. Bucket and shard
boundaries may cut through a parameter; :meth:`FlatLayout.shard_pieces` says which part of
which parameter each stretch of the shard holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """A parameter's place in the flat buffer: elements ``[start, start + numel)``."""

    name: str
    param: nn.Parameter
    start: int
    numel: int
    shape: torch.Size

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class ShardPiece:
    """Elements ``[lo, hi)`` of row ``bucket`` of the shard hold ``slot``'s flat elements
    ``[offset, offset + hi - lo)``."""

    slot: Slot
    bucket: int
    lo: int
    hi: int
    offset: int


class FlatLayout:
    """Parameters laid end to end, padded, cut into equal buckets; this rank owns a chunk of each."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], *, world: int, rank: int,
                 bucket_numel: int | None = None) -> None:
        self.world, self.rank = world, rank
        self.slots: list[Slot] = []
        offset = 0
        for name, p in named:
            self.slots.append(Slot(name, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.numel = offset                                   # logical elements (Ψ of the group)
        n = max(1, math.ceil(offset / bucket_numel)) if bucket_numel else 1
        self.chunk = max(1, math.ceil(offset / (n * world)))  # elements per rank per bucket
        self.bucket_numel = world * self.chunk
        self.n_buckets = max(1, math.ceil(offset / self.bucket_numel))  # no all-padding bucket
        self.padded = self.n_buckets * self.bucket_numel

    # ---------------------------------------------------------------- views
    def new(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A zeroed flat buffer, (padded,)."""
        return torch.zeros(self.padded, dtype=dtype, device=device)

    def view(self, flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        """``slot``'s parameter-shaped view into ``flat``."""
        return flat[slot.start : slot.end].view(slot.shape)

    def bucket(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        """Bucket ``b`` of ``flat``, (world * chunk,)."""
        return flat[b * self.bucket_numel : (b + 1) * self.bucket_numel]

    def chunk_of(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        """This rank's chunk of bucket ``b`` (a slice of the bucket), (chunk,)."""
        start = b * self.bucket_numel + self.rank * self.chunk
        return flat[start : start + self.chunk]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunks of every bucket as one strided view, (n_buckets, chunk)."""
        return flat.view(self.n_buckets, self.world, self.chunk)[:, self.rank]

    def fill(self, flat: torch.Tensor) -> None:
        """Copy each parameter's current value into ``flat``."""
        with torch.no_grad():
            for s in self.slots:
                flat[s.start : s.end].copy_(s.param.reshape(-1))

    def fill_shard(self, shard: torch.Tensor) -> None:
        """Copy this rank's elements of each parameter's current value into ``shard``,
        (n_buckets, chunk), without building the whole flat buffer."""
        with torch.no_grad():
            for pc in self.shard_pieces():
                n = pc.hi - pc.lo
                shard[pc.bucket, pc.lo : pc.hi].copy_(pc.slot.param.reshape(-1)[pc.offset : pc.offset + n])

    # ---------------------------------------------------------------- geometry
    def slots_in(self, b: int) -> list[tuple[Slot, int, int]]:
        """(slot, lo, hi): the slots overlapping bucket ``b``, as flat element ranges."""
        lo_b, hi_b = b * self.bucket_numel, (b + 1) * self.bucket_numel
        return [(s, max(s.start, lo_b), min(s.end, hi_b)) for s in self.slots
                if s.start < hi_b and s.end > lo_b]

    def shard_pieces(self) -> list[ShardPiece]:
        """Which parameter elements this rank's shard holds, piece by piece."""
        pieces = []
        for b in range(self.n_buckets):
            lo_c = b * self.bucket_numel + self.rank * self.chunk
            hi_c = lo_c + self.chunk
            for s in self.slots:
                lo, hi = max(s.start, lo_c), min(s.end, hi_c)
                if lo < hi:
                    pieces.append(ShardPiece(s, b, lo - lo_c, hi - lo_c, lo - s.start))
        return pieces
