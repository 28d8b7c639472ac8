"""Vocab-parallel cross-entropy: the loss of vocab-sharded logits, never gathering them.

Rank r holds logits for vocab ids [r·V/n, (r+1)·V/n). Per token, three reductions over the TP
group complete the softmax statistics (Megatron's ``vocab_parallel_cross_entropy``):

    fwd: m = all-reduce(max) of the local maxima;  (b·s floats)
         [Σ exp(z - m), z_target - m] = all-reduce(sum) of the local parts  (2·b·s floats)
         loss_t = log Σ exp(z - m) - (z_target - m)
    bwd: d loss_t / d z_local = softmax_local - onehot_local — no communication.

Only (b·s, V/n) tensors exist on any rank. The result is ``(loss_sum, token_count)`` like
:class:`~trainmesh.models.gpt.CrossEntropySum`; labels equal to ``ignore_index`` are skipped.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.core.dtypes import wide

from ..comm import Comm
from .layers import TPState


class _VocabParallelCE(torch.autograd.Function):
    """(N, V/n) local logits, (N,) labels -> scalar loss sum (fp32, or fp64 for fp64 logits)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, comm: Comm, axis: str,
                ignore_index: int) -> torch.Tensor:
        z = logits.to(wide(logits.dtype))   # (N, V/n), >= fp32
        width = z.shape[-1]
        start = comm.mesh.index(axis) * width
        m = z.max(dim=-1).values                                  # (N,)
        comm.all_reduce(m, axis, op=dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)                                   # (N, V/n), <= 0
        exp = z.exp()
        local = labels - start
        mine = (local >= 0) & (local < width)                     # (N,) target on this rank
        local = local.masked_fill(~mine, 0)
        target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        stats = torch.stack([exp.sum(dim=-1), target])            # (2, N)
        comm.all_reduce(stats, axis)
        sum_exp, target = stats[0], stats[1]
        valid = labels != ignore_index                            # (N,)
        loss = ((sum_exp.log() - target) * valid).sum()
        exp.div_(sum_exp.unsqueeze(-1))                           # softmax, (N, V/n)
        ctx.save_for_backward(exp, local, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine, valid = ctx.saved_tensors
        g = softmax                                               # reuse the saved buffer
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= mine.to(g.dtype)
        g.mul_((valid.to(g.dtype) * grad).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, comm: Comm,
                                 axis: str = "tp", *, ignore_index: int = -100
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V/n) local logits, (...) labels -> (sum of token losses, counted tokens).

    The same loss on every rank of the group; ``logits`` keeps only this rank's vocab slice.
    """
    flat = logits.reshape(-1, logits.shape[-1])                   # (b·s, V/n)
    loss = _VocabParallelCE.apply(flat, labels.reshape(-1), comm, axis, ignore_index)
    return loss, (labels != ignore_index).sum()


class VocabParallelCrossEntropy(nn.Module):
    """Drop-in for a ``(logits, labels) -> (loss_sum, count)`` criterion on vocab-sharded logits."""

    def __init__(self, state: TPState, *, ignore_index: int = -100) -> None:
        super().__init__()
        self.state, self.ignore_index = state, ignore_index

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_cross_entropy(logits, labels, self.state.comm, self.state.axis,
                                            ignore_index=self.ignore_index)
