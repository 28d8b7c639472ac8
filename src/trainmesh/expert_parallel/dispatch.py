"""The token exchange of one MoE layer over the ``ep`` group (docs/EXPERT_PARALLEL.md).

Rank ``r`` of an ``ep`` group of size ``n`` holds experts ``[r L, (r + 1) L)``, ``L = E / n``.
Its rows arrive sorted by global expert, so the rows for rank ``j`` are one contiguous run:

1. the per-expert row counts (E int64) go through an equal-split all-to-all: each rank learns
   how many rows every rank sends to each of its L experts;
2. the rows go through a variable-split all-to-all (:class:`AllToAll`): rank ``j`` receives, per
   source rank, that rank's rows for its experts, in expert order;
3. they are regrouped by local expert (for each expert, the sources in rank order), the experts
   run, the outputs are put back in (source, expert) order and return by the reverse all-to-all.

:class:`AllToAll`'s backward is the all-to-all with the splits swapped, so gradients travel the
same routes back. Every rank of the group issues the same three collectives per layer and
microbatch (and two in backward), whatever the routing: a rank with no rows sends empty runs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from trainmesh.comm import Comm


class AllToAll(torch.autograd.Function):
    """``x`` (rows) -> the rows other ranks send, over ``axis``; backward: the reverse route."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str, send: list[int],
                recv: list[int]) -> torch.Tensor:
        ctx.comm, ctx.axis, ctx.send, ctx.recv = comm, axis, send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), axis, out_splits=recv, in_splits=send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        ctx.comm.all_to_all_v(out, grad.contiguous(), ctx.axis, out_splits=ctx.send, in_splits=ctx.recv)
        return out, None, None, None, None


class ExpertExchange:
    """The :class:`~trainmesh.models.moe.Exchange` of one rank: its experts are the
    ``index``-th run of ``n_experts / size`` over the ``axis`` group."""

    def __init__(self, comm: Comm, n_experts: int, *, axis: str = "ep") -> None:
        self.comm, self.axis = comm, axis
        self.size = comm.mesh.size(axis)
        self.local = n_experts // self.size

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> tuple[torch.Tensor, int]:
        n, local = self.size, self.local
        incoming = torch.empty_like(counts)
        self.comm.all_to_all(incoming, counts, self.axis)     # [source, my expert] row counts
        sizes = incoming.view(n, local)
        send = counts.view(n, local).sum(1).tolist()
        recv = sizes.sum(1).tolist()
        got = AllToAll.apply(rows, self.comm, self.axis, send, recv)
        flat_sizes = sizes.reshape(-1).tolist()                # chunks in (source, expert) order
        chunks = got.split(flat_sizes)
        by_expert = [i * local + e for e in range(local) for i in range(n)]
        out = compute(torch.cat([chunks[j] for j in by_expert]), sizes.sum(0).tolist())
        back: list[torch.Tensor] = [out] * len(by_expert)
        for j, piece in zip(by_expert, out.split([flat_sizes[j] for j in by_expert])):
            back[j] = piece                                    # back to (source, expert) order
        return AllToAll.apply(torch.cat(back), self.comm, self.axis, recv, send), int(sum(recv))
