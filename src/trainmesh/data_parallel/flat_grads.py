"""Where a flat ZeRO stage keeps its gradients, and what one bucket's reduction takes.

The two stages of :class:`~.zero.FlatZero` differ only here:

- :class:`FullGrads` (ZeRO-1): like DDP, every ``param.grad`` is a view into a full flat
  gradient buffer that accumulates over microbatches; in the step's last backward each bucket,
  once complete, is reduce-scattered *in place*, so the reduced shard sits inside the gradient
  buffer (no copy). Traffic per step: reduce_scatter 4Ψ.
- :class:`StagedGrads` (ZeRO-2): only the reduced shard persists. A gradient is added into its
  bucket's transient buffer as soon as autograd produces it (and dropped from ``param.grad``),
  and every backward's buckets go out, the reduced chunk added to the shard. Traffic per step:
  reduce_scatter m·4Ψ.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .buckets import Bucket
from .flat import FlatLayout, Slot
from .inflight import Reductions


@dataclass
class FlatBucket(Bucket):
    """Bucket ``index`` of optimizer group ``group``'s flat layout."""

    group: int = 0
    layout: FlatLayout | None = None
    slots: list[tuple[Slot, int, int]] | None = None     # (slot, lo, hi): flat element ranges
    staging: torch.Tensor | None = None                   # ZeRO-2: the bucket's full gradient


class FullGrads:
    """ZeRO-1: a full gradient buffer per group, reduced once, in the step's last backward."""

    every_backward = False
    """Reduce in every backward (else only in the last of the step)."""

    def __init__(self, reductions: Reductions, reduce_dtype: torch.dtype | None) -> None:
        self.reductions, self.reduce_dtype = reductions, reduce_dtype

    def buffers(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the group's persistent gradient buffer, its (n_buckets, chunk) reduced shard)."""
        grads = layout.new(dtype, device)                      # (padded,) every param.grad a view
        for s in layout.slots:
            s.param.grad = layout.view(grads, s)
        return grads, layout.shard(grads)

    def take(self, p: nn.Parameter, buckets: list[FlatBucket]) -> None:
        """``p``'s gradient already sits in the buffer."""

    def reduce(self, b: FlatBucket, grads: torch.Tensor, shard: torch.Tensor, final: tuple | None) -> None:
        """Reduce-scatter bucket ``b`` of the group's ``grads`` into its row of ``shard``."""
        buf = b.layout.bucket(grads, b.index)
        transient = self.reduce_dtype is not None and self.reduce_dtype != buf.dtype
        if transient:   # reduce in reduce_dtype: a cast copy, then the shard is copied back
            buf = self.reductions.alloc(buf.numel(), self.reduce_dtype).copy_(buf)
        self.reductions.reduce_scatter(buf, shard[b.index], accumulate=False, transient=transient,
                                       final=final)


class StagedGrads(FullGrads):
    """ZeRO-2: only the shard persists; gradients pass through transient bucket buffers."""

    every_backward = True

    def buffers(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
        shard = torch.zeros(layout.n_buckets, layout.chunk, dtype=dtype, device=device)
        return shard, shard

    def take(self, p: nn.Parameter, buckets: list[FlatBucket]) -> None:
        """Add ``p.grad`` into its buckets' transient buffers (zeroed when allocated), then drop it."""
        grad = p.grad.reshape(-1)
        for b in buckets:
            if b.staging is None:
                b.staging = self.reductions.alloc(b.layout.bucket_numel, self.reduce_dtype or grad.dtype)
            base = b.index * b.layout.bucket_numel
            for s, lo, hi in b.slots:
                if s.param is p:
                    b.staging[lo - base : hi - base].add_(grad[lo - s.start : hi - s.start])
        p.grad = None

    def reduce(self, b: FlatBucket, grads: torch.Tensor, shard: torch.Tensor, final: tuple | None) -> None:
        buf = b.staging if b.staging is not None else self.reductions.alloc(
            b.layout.bucket_numel, self.reduce_dtype or grads.dtype)
        b.staging = None
        self.reductions.reduce_scatter(buf, shard[b.index], accumulate=True, transient=True, final=final)
