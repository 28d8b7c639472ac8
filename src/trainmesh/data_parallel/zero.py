"""ZeRO-1 and ZeRO-2 (:class:`FlatZero`): optimizer states (ZeRO-1) and gradients too
(ZeRO-2) sharded over the strategy's group.

Per optimizer group, the parameters live in one flat, padded buffer (each ``param.data`` is a
view into it, laid out in reverse registration order, the order gradients tend to become
ready) cut into equal buckets; this rank owns one chunk of every bucket (:mod:`.flat`). The
optimizer updates a flat shard ``nn.Parameter`` that is a strided view of those chunks, so
the update lands in the model's parameters; after the step every bucket is all-gathered in
place (all_gather 4Ψ).

The stage is a component (:mod:`.flat_grads`): where gradients live and what a bucket's
reduction takes — ZeRO-1 a full accumulating buffer reduced in the last backward
(reduce_scatter 4Ψ), ZeRO-2 transient buckets reduced every backward (reduce_scatter m·4Ψ).
Buckets go through the shared :class:`~.buckets.Bucketer` (one global launch order).

Under a pipeline (``expect_backwards(m)``): ZeRO-1 reduces each gradient after its last
backward of the step (:class:`~.readiness.Readiness`); ZeRO-2 reduces per *round*: a bucket goes
out once every parameter in it has given a gradient since its last reduction, whatever the
interleaving of microbatches, so with one chunk per rank every bucket is reduced exactly ``m``
times (with interleaved chunks a bucket spanning two chunks sums gradients of different
microbatches before it goes out: the same sum, fewer reductions); a partial round left at the
end is reduced by ``finish``.

Mixed precision (``options.param_dtype``): the flat parameters and gradients are 16-bit and the
optimizer updates an fp32 master shard (:mod:`.master`), cast back into this rank's chunks
before the all-gather, which so moves 16-bit values: 2Ψ + 2Ψ + 12Ψ/N bytes at ZeRO-1,
2Ψ + (2Ψ + 12Ψ)/N at ZeRO-2 (AdamW); all_gather 2Ψ.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from .base import SyncOptions
from .buckets import Bucketer
from .flat import FlatLayout, Slot
from .flat_grads import FlatBucket, FullGrads, StagedGrads
from .master import MasterWeights
from .sharded import Groups, ShardedSync


@dataclass
class _Group:
    layout: FlatLayout
    params: torch.Tensor             # (padded,) the model's parameters (views into it)
    grads: torch.Tensor              # the persistent gradients: ZeRO-1 (padded,), ZeRO-2 the shard
    shard_grad: torch.Tensor         # (n_buckets, chunk): ZeRO-1 a view of grads, ZeRO-2 grads


class FlatZero(ShardedSync):
    """ZeRO stage 1 or 2 over flat parameter buffers (module docstring)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None, *, stage: int = 1) -> None:
        super().__init__(named_params, comm, options)
        self.stage = stage
        self.grads = (StagedGrads if stage == 2 else FullGrads)(self.reductions, self.reduce_dtype)
        self.groups: list[_Group] = []
        self.buckets: list[FlatBucket] = []
        self.bucketer: Bucketer[FlatBucket] = Bucketer([], self._launch)
        self._sync = False           # this backward reduces
        self._last = False           # this backward is the step's last: its reductions are final

    # ---------------------------------------------------------------- set-up
    @torch.no_grad()
    def _setup(self, groups: Groups) -> None:
        order = {id(p): i for i, (_, p) in enumerate(reversed(self.named_params))}
        keyed: list[tuple[int, int, FlatBucket]] = []
        low = self.options.param_dtype
        masters, lows = [], []
        for gi, (_, named) in enumerate(groups):
            named = sorted(named, key=lambda item: order[id(item[1])])
            master_dtype = named[0][1].dtype
            dtype = low or master_dtype
            layout = FlatLayout(named, world=self.dp, rank=self.rank_in_dp,
                                bucket_numel=max(1, self.bucket_bytes // dtype.itemsize))
            params = layout.new(dtype, self.device)
            if dtype != master_dtype:   # mixed precision: an fp32 master of this rank's shard
                master = torch.zeros(layout.n_buckets, layout.chunk, dtype=master_dtype, device=self.device)
                layout.fill_shard(master)
                masters.append(nn.Parameter(master))
                lows.append(layout.shard(params))
            layout.fill(params)
            for s in layout.slots:
                s.param.data = layout.view(params, s)
            grads, shard_grad = self.grads.buffers(layout, dtype, self.device)
            shard = masters[-1] if dtype != master_dtype else nn.Parameter(layout.shard(params))
            if dtype == master_dtype:
                shard.grad = shard_grad
            self.shard_params.append(shard)
            self.grad_shards.append(shard_grad)
            self.groups.append(_Group(layout, params, grads, shard_grad))
            for piece in layout.shard_pieces():
                self._norm_pieces.append((piece.slot.name, piece.slot.param,
                                          shard_grad[piece.bucket, piece.lo : piece.hi]))
            for b in range(layout.n_buckets):
                slots = layout.slots_in(b)
                key = max((order[id(s.param)] for s, _, _ in slots), default=-1)
                bucket = FlatBucket(b, [s.param for s, _, _ in slots], group=gi, layout=layout, slots=slots)
                keyed.append((key, gi, bucket))
        self.buckets = [b for _, _, b in sorted(keyed, key=lambda t: (t[0], t[1], t[2].index))]
        self.bucketer = Bucketer(self.buckets, self._launch)
        for _, p in self.named_params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if masters:
            self.master = MasterWeights(masters, lows, self.grad_shards)

    # ---------------------------------------------------------------- backward
    def before_backward(self, *, is_last: bool) -> None:
        if self._sync and self.grads.every_backward:
            self.bucketer.flush()       # a previous microbatch left parameters without grads
        self.readiness.start()
        self._sync = is_last or self.grads.every_backward
        self._last = is_last
        self.bucketer.arm()

    def expect_backwards(self, n: int, held: Sequence[nn.Parameter] = ()) -> None:
        if not self.grads.every_backward:   # ZeRO-1: reduce after a gradient's last backward
            super().expect_backwards(n, held)
            return
        self.readiness.start()              # ZeRO-2: every gradient goes out, round by round
        self._sync, self._last = True, False   # (buckets reduce several times: copied at the step)
        self.bucketer.arm()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.readiness.final(p) and self._sync:
            self.grads.take(p, self.bucketer.buckets_of(p))
            self.bucketer.give(p)

    def _no_grad(self, p: nn.Parameter) -> None:
        if self.readiness.passed(p) and self._sync:   # nothing to add to its buckets
            self.bucketer.give(p)

    def _launch(self, b: FlatBucket) -> None:
        """Reduce-scatter bucket ``b`` into this rank's gradient shard."""
        g = self.groups[b.group]
        self.grads.reduce(b, g.grads, g.shard_grad, (b.group, b.index) if self._last else None)

    def finish(self, scale: float) -> None:
        self._backward_done()
        if self._sync:
            self._check_unused()
            self.bucketer.flush()
            self.bucketer.arm()
        self.reductions.drain()
        self._scale(scale)

    # ---------------------------------------------------------------- step
    def _after_step(self) -> None:
        """All-gather every bucket of the updated parameters, in place (mixed precision: the
        masters were cast into this rank's 16-bit chunks by the step)."""
        handles = [self.comm.all_gather(g.layout.bucket(g.params, b), g.layout.chunk_of(g.params, b),
                                        self.axis, async_op=True)
                   for g in self.groups for b in range(g.layout.n_buckets)]
        for h in handles:
            if h is not None:
                h.wait()

    def zero_grad(self) -> None:
        self._end_step()
        for g in self.groups:
            g.grads.zero_()
        self._reset_master()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [g.params for g in self.groups], "grads": [g.grads for g in self.groups],
                "optimizer": self._optimizer_tensors()}

    def _ranges(self, gi: int) -> dict[int, list[tuple[int, slice]]]:
        out: dict[int, list[tuple[int, slice]]] = {}
        for pc in self.groups[gi].layout.shard_pieces():
            out.setdefault(id(pc.slot.param), []).append((pc.bucket, slice(pc.lo, pc.hi)))
        return out

    def _stretches(self, gi: int) -> list[tuple[Slot, tuple[int, slice], int, int]]:
        return [(pc.slot, (pc.bucket, slice(pc.lo, pc.hi)), pc.offset, pc.hi - pc.lo)
                for pc in self.groups[gi].layout.shard_pieces()]

    # ---------------------------------------------------------------- checkpoints
    def _slots(self, gi: int) -> list[Slot]:
        return self.groups[gi].layout.slots

    def _whole(self, gi: int, shard: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
        g = self.groups[gi]
        layout = g.layout
        if shard.data_ptr() == layout.shard(g.params).data_ptr():
            flat = g.params                    # the parameters themselves: already whole
        else:
            flat = layout.new(shard.dtype, self.device)
            for b in range(layout.n_buckets):
                self.comm.all_gather(layout.bucket(flat, b), shard[b].to(self.device).contiguous(), self.axis)
        return [(s, layout.view(flat, s)) for s in layout.slots]

    @torch.no_grad()
    def _take_shard(self, gi: int, whole: dict[int, torch.Tensor], dst: torch.Tensor) -> None:
        for piece in self.groups[gi].layout.shard_pieces():
            src = whole.get(id(piece.slot.param))
            if src is not None:
                n = piece.hi - piece.lo
                dst[piece.bucket, piece.lo : piece.hi].copy_(src.reshape(-1)[piece.offset : piece.offset + n])

    def _after_load(self) -> None:
        self._after_step()


class Zero1(FlatZero):
    """ZeRO stage 1: optimizer states sharded; full gradients accumulate over microbatches and
    are reduce-scattered in place during the last backward."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None) -> None:
        super().__init__(named_params, comm, options, stage=1)


class Zero2(FlatZero):
    """ZeRO stage 2: gradients sharded too; reduce-scattered during every backward, each rank
    keeping only its accumulated shard."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None) -> None:
        super().__init__(named_params, comm, options, stage=2)
