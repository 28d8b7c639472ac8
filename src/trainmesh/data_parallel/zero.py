"""ZeRO-1 and ZeRO-2 (:class:`Zero1`, :class:`Zero2`): optimizer states (ZeRO-1) and gradients
too (ZeRO-2) sharded over DP, on what they share (:class:`FlatZero`).

Per optimizer group, the parameters live in one flat, padded buffer (each ``param.data`` is a
view into it, laid out in reverse registration order, the order gradients tend to become
ready) cut into equal buckets; this rank owns one chunk of every bucket (:mod:`.flat`). The
optimizer updates a flat shard ``nn.Parameter`` that is a strided view of those chunks, so
the update lands in the model's parameters; after the step every bucket is all-gathered in
place.

- ZeRO-1: like DDP, ``param.grad`` are views into a full flat gradient buffer that accumulates
  over microbatches; during the last backward each bucket, once complete, is reduce-scattered
  in place, so the reduced shard sits inside the gradient buffer (no copy). Traffic per step:
  dp.reduce_scatter 4Ψ + dp.all_gather 4Ψ.
- ZeRO-2: gradients are reduce-scattered during *every* microbatch's backward; a gradient is
  copied into its bucket's transient buffer as soon as autograd produces it (and dropped from
  ``param.grad``), the bucket goes out when complete, and the reduced chunk is added to this
  rank's persistent gradient shard. Traffic: dp.reduce_scatter m·4Ψ + dp.all_gather 4Ψ.

Buckets are launched strictly in one global order (the same on every rank), as in DDP.

Mixed precision (``options.param_dtype``): the flat parameters and gradients are 16-bit and the
optimizer updates an fp32 master shard (:mod:`.master`), cast back into this rank's chunks
before the all-gather, which so moves 16-bit values: 2Ψ + 2Ψ + 12Ψ/N bytes at ZeRO-1,
2Ψ + (2Ψ + 12Ψ)/N at ZeRO-2 (AdamW); dp.all_gather 2Ψ.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Comm
from .base import BucketOrder, SyncOptions
from .flat import FlatLayout, Slot
from .master import MasterWeights
from .sharded import Groups, ShardedSync


@dataclass
class _Group:
    layout: FlatLayout
    params: torch.Tensor             # (padded,) the model's parameters (views into it)
    grads: torch.Tensor              # the persistent gradients: ZeRO-1 (padded,), ZeRO-2 the shard
    shard_grad: torch.Tensor         # (n_buckets, chunk): ZeRO-1 a view of grads, ZeRO-2 grads


@dataclass
class _Bucket:
    group: int
    index: int                        # bucket index within its group's layout
    slots: list[tuple[Slot, int, int]]
    pending: int = 0
    staging: torch.Tensor | None = None   # ZeRO-2: the bucket's full gradient, transient


class FlatZero(ShardedSync):
    """What ZeRO-1 and ZeRO-2 share: flat parameter buffers, buckets launched in one order,
    the all-gather after the step, checkpoints. Subclasses say where gradients live
    (:meth:`_grad_buffers`), when they are reduced and how a bucket goes out (:meth:`_launch`)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None) -> None:
        super().__init__(named_params, comm, options)
        self.groups: list[_Group] = []
        self.buckets: list[_Bucket] = []
        self._buckets_of: dict[int, list[_Bucket]] = {}
        self._sync = False
        self._order: BucketOrder[_Bucket] = BucketOrder(self._launch)

    # ---------------------------------------------------------------- set-up
    @abstractmethod
    def _grad_buffers(self, layout: FlatLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the group's persistent gradient buffer, its (n_buckets, chunk) reduced shard)."""

    @torch.no_grad()
    def _setup(self, groups: Groups) -> None:
        order = {id(p): i for i, (_, p) in enumerate(reversed(self.named_params))}
        keyed: list[tuple[int, int, _Bucket]] = []
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
            grads, shard_grad = self._grad_buffers(layout, dtype)
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
                keyed.append((key, gi, _Bucket(gi, b, slots)))
        self.buckets = [b for _, _, b in sorted(keyed, key=lambda t: (t[0], t[1], t[2].index))]
        for bucket in self.buckets:
            for s, _, _ in bucket.slots:
                self._buckets_of.setdefault(id(s.param), []).append(bucket)
        for _, p in self.named_params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if masters:
            self.master = MasterWeights(masters, lows, self.grad_shards)

    # ---------------------------------------------------------------- backward
    def _start_backward(self, *, reduce: bool) -> None:
        self._sync = reduce
        self._remaining = None
        self._ready = set()
        self._order.reset(self.buckets)
        for b in self.buckets:
            b.pending = len(b.slots)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._grad_final(p) or not self._sync:
            return
        buckets = self._buckets_of[id(p)]
        self._take_grad(p, buckets)
        for b in buckets:
            b.pending -= 1
        self._order.launch_ready()

    def _take_grad(self, p: nn.Parameter, buckets: list[_Bucket]) -> None:
        """What to do with ``p``'s final gradient before its buckets count it (ZeRO-1: nothing,
        it already sits in the gradient buffer)."""

    @abstractmethod
    def _launch(self, b: _Bucket) -> None:
        """Reduce-scatter bucket ``b`` into this rank's gradient shard."""

    def finish(self, scale: float) -> None:
        self._backward_done()
        if self._sync:
            self._check_unused()
            self._order.launch_ready(force=True)
        self._drain()
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

    def _shard_ranges(self, p: nn.Parameter) -> list[tuple[int, tuple[int, slice]]]:
        return [(gi, (pc.bucket, slice(pc.lo, pc.hi))) for gi, g in enumerate(self.groups)
                for pc in g.layout.shard_pieces() if pc.slot.param is p]

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

    stage = 1

    def _grad_buffers(self, layout: FlatLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        grads = layout.new(dtype, self.device)                 # (padded,) every param.grad a view
        for s in layout.slots:
            s.param.grad = layout.view(grads, s)
        return grads, layout.shard(grads)

    def before_backward(self, *, is_last: bool) -> None:
        self._start_backward(reduce=is_last)

    def _launch(self, b: _Bucket) -> None:
        g = self.groups[b.group]
        buf = g.layout.bucket(g.grads, b.index)
        transient = self.reduce_dtype is not None and self.reduce_dtype != buf.dtype
        if transient:   # reduce in reduce_dtype: a cast copy, then the shard is copied back
            buf = self._alloc(buf.numel(), self.reduce_dtype).copy_(buf)
        self._reduce_scatter(buf, g.shard_grad[b.index], accumulate=False, transient=transient,
                             final=(b.group, b.index))   # reduced once, in the last backward


class Zero2(FlatZero):
    """ZeRO stage 2: gradients sharded too; reduce-scattered during every microbatch's backward,
    each rank keeping only its accumulated shard."""

    stage = 2

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
                 options: SyncOptions | None = None) -> None:
        super().__init__(named_params, comm, options)
        self._pipeline_bytes = 0
        self._last = False           # this backward is the step's last: its reductions are final

    def _grad_buffers(self, layout: FlatLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shard = torch.zeros(layout.n_buckets, layout.chunk, dtype=dtype, device=self.device)
        return shard, shard

    def before_backward(self, *, is_last: bool) -> None:
        if self._sync:
            self._order.launch_ready(force=True)   # a previous microbatch left parameters without grads
        self._start_backward(reduce=True)
        self._last = is_last

    def expect_backwards(self, n: int) -> None:
        """(Meanwhile the gradients accumulate full-size in ``param.grad``: counted as transient.)"""
        super().expect_backwards(n)
        self._pipeline_bytes = sum(p.numel() * p.element_size() for _, p in self.named_params)
        self._count(self._pipeline_bytes)

    def _take_grad(self, p: nn.Parameter, buckets: list[_Bucket]) -> None:
        """Add ``p.grad`` into its buckets' transient buffers (zeroed when allocated), then drop it."""
        grad = p.grad.reshape(-1)
        for b in buckets:
            layout = self.groups[b.group].layout
            if b.staging is None:
                b.staging = self._alloc(layout.bucket_numel, self.reduce_dtype or grad.dtype)
            base = b.index * layout.bucket_numel
            for s, lo, hi in b.slots:
                if s.param is p:
                    b.staging[lo - base : hi - base].add_(grad[lo - s.start : hi - s.start])
        p.grad = None

    def _launch(self, b: _Bucket) -> None:
        g = self.groups[b.group]
        buf = b.staging if b.staging is not None else self._alloc(
            g.layout.bucket_numel, self.reduce_dtype or g.params.dtype)
        b.staging = None
        self._reduce_scatter(buf, g.shard_grad[b.index], accumulate=True, transient=True,
                             final=(b.group, b.index) if self._last else None)

    def finish(self, scale: float) -> None:
        super().finish(scale)
        self._live_bytes -= self._pipeline_bytes
        self._pipeline_bytes = 0
