"""Differentiable collectives of tensor parallelism: Megatron's f and g operators and their kin.

Each op is a small :class:`torch.autograd.Function` whose forward is one collective (or none)
and whose backward is its dual; every byte goes through :class:`~trainmesh.comm.Comm` under the
given mesh axis, so the ledger books it (docs/METRICS.md, ``comm_bytes_per_step``). ``n`` below is
the size of the group along ``axis``; on a group of one every op is the identity::

    copy_to_region (f)              fwd identity                    bwd all-reduce
    reduce_from_region (g)          fwd all-reduce                  bwd identity
    scatter_to_region               fwd split last dim, keep own    bwd all-gather last dim
    gather_from_region              fwd all-gather last dim         bwd split last dim
    scatter_to_sequence             fwd split dim 1, keep own       bwd all-gather dim 1
    gather_from_sequence (SP f)     fwd all-gather dim 1            bwd reduce-scatter dim 1 (or split)
    reduce_scatter_to_sequence (g)  fwd reduce-scatter dim 1        bwd all-gather dim 1

Collectives never work in place on their argument: the result is a fresh tensor, so a caller
may keep using its input (and autograd never sees an input modified behind its back).
"""
from __future__ import annotations

import torch

from ..comm import Comm

SEQ_DIM = 1  # activations are (batch, seq, hidden)


def _size_rank(comm: Comm, axis: str) -> tuple[int, int]:
    return comm.mesh.size(axis), comm.mesh.index(axis)


# ---------------------------------------------------------------- plain (non-autograd) helpers
def _all_reduce(x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, axis)
    return out


def _split(x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
    n, rank = _size_rank(comm, axis)
    if x.shape[dim] % n:
        what = "sequence length" if dim == SEQ_DIM else f"dim {dim}"
        raise ValueError(f"tensor parallel split: {what} {x.shape[dim]} is not divisible by "
                         f"{axis}={n}")
    width = x.shape[dim] // n
    return x.narrow(dim, rank * width, width).contiguous()


def _gather(x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    n, _ = _size_rank(comm, axis)
    dim = dim % x.dim()
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))    # backends split the output along dim 0
    comm.all_gather(out, x, axis)
    shape = list(x.shape)
    shape[dim] *= n
    return out.view(n, *x.shape).movedim(0, dim).reshape(shape)   # (..., n * x.shape[dim], ...)


def _reduce_scatter(x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    n, _ = _size_rank(comm, axis)
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"tensor parallel reduce-scatter: dim {dim} of size {x.shape[dim]} is "
                         f"not divisible by {axis}={n}")
    shape = list(x.shape)
    shape[dim : dim + 1] = [n, x.shape[dim] // n]
    chunks = x.reshape(shape).movedim(dim, 0).contiguous()   # (n, ..., x.shape[dim] / n, ...)
    out = x.new_empty(chunks.shape[1:])
    comm.reduce_scatter(out, chunks.flatten(0, 1), axis)     # backends split the input along dim 0
    return out


# ---------------------------------------------------------------- autograd functions
class _CopyToRegion(torch.autograd.Function):
    """fwd: identity; bwd: all-reduce. Shapes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
        ctx.comm, ctx.axis = comm, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.comm, ctx.axis), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """fwd: all-reduce; bwd: identity. Shapes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axis: str) -> torch.Tensor:
        return _all_reduce(x, comm, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


class _Split(torch.autograd.Function):
    """fwd: keep this rank's chunk along ``dim``; bwd: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
        ctx.dim, ctx.comm, ctx.axis = dim, comm, axis
        return _split(x, dim, comm, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, ctx.comm, ctx.axis), None, None, None


class _Gather(torch.autograd.Function):
    """fwd: all-gather along ``dim``; bwd: reduce-scatter (``partial_grad``) or split."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, comm: Comm, axis: str,
                partial_grad: bool) -> torch.Tensor:
        ctx.dim, ctx.comm, ctx.axis, ctx.partial = dim, comm, axis, partial_grad
        return _gather(x, dim, comm, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        op = _reduce_scatter if ctx.partial else _split
        return op(grad, ctx.dim, ctx.comm, ctx.axis), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """fwd: reduce-scatter along ``dim``; bwd: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, comm: Comm, axis: str) -> torch.Tensor:
        ctx.dim, ctx.comm, ctx.axis = dim, comm, axis
        return _reduce_scatter(x, dim, comm, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, ctx.comm, ctx.axis), None, None, None


# ---------------------------------------------------------------- the public operators
def _trivial(comm: Comm, axis: str) -> bool:
    return comm.mesh.size(axis) == 1


def copy_to_region(x: torch.Tensor, comm: Comm, axis: str = "tp") -> torch.Tensor:
    """f: fwd identity, bwd all-reduce of the gradient. (b, s, h) -> (b, s, h).

    Enters a column-parallel region: the input is replicated, each rank's input gradient is a
    partial sum that the backward all-reduce completes.
    """
    return x if _trivial(comm, axis) else _CopyToRegion.apply(x, comm, axis)


def reduce_from_region(x: torch.Tensor, comm: Comm, axis: str = "tp") -> torch.Tensor:
    """g: fwd all-reduce (sum of partial outputs), bwd identity. (b, s, h) -> (b, s, h)."""
    return x if _trivial(comm, axis) else _ReduceFromRegion.apply(x, comm, axis)


def scatter_to_region(x: torch.Tensor, comm: Comm, axis: str = "tp") -> torch.Tensor:
    """fwd keep own chunk of the last dim, bwd all-gather. (..., h) -> (..., h/n)."""
    return x if _trivial(comm, axis) else _Split.apply(x, -1, comm, axis)


def gather_from_region(x: torch.Tensor, comm: Comm, axis: str = "tp") -> torch.Tensor:
    """fwd all-gather along the last dim, bwd keep own chunk. (..., h/n) -> (..., h)."""
    return x if _trivial(comm, axis) else _Gather.apply(x, -1, comm, axis, False)


def scatter_to_sequence(x: torch.Tensor, comm: Comm, axis: str = "tp") -> torch.Tensor:
    """fwd keep own chunk of the sequence, bwd all-gather. (b, s, h) -> (b, s/n, h).

    Enters the sequence-parallel region from a replicated activation (e.g. the embeddings).
    """
    return x if _trivial(comm, axis) else _Split.apply(x, SEQ_DIM, comm, axis)


def gather_from_sequence(x: torch.Tensor, comm: Comm, axis: str = "tp", *,
                         partial_grad: bool = True, dim: int = SEQ_DIM) -> torch.Tensor:
    """fwd all-gather along the sequence, bwd reduce-scatter. (b, s/n, h) -> (b, s, h).

    The sequence-parallel f: with ``partial_grad`` (the consumer is column-parallel, so each
    rank's gradient is a partial sum) the backward reduce-scatters; without it (a replicated
    consumer, identical gradients on every rank) the backward just keeps this rank's chunk.
    ``dim=0``: of tokens flattened to rows, (b·s/n, h) -> (n·b·s/n, h), rank by rank.
    """
    if _trivial(comm, axis):
        return x
    return _Gather.apply(x, dim, comm, axis, partial_grad)


def reduce_scatter_to_sequence(x: torch.Tensor, comm: Comm, axis: str = "tp", *,
                               dim: int = SEQ_DIM) -> torch.Tensor:
    """The sequence-parallel g: fwd reduce-scatter along the sequence, bwd all-gather.

    (b, s, h) partial sums -> (b, s/n, h) complete sums of this rank's sequence chunk (``dim``
    as :func:`gather_from_sequence`'s).
    """
    return x if _trivial(comm, axis) else _ReduceScatter.apply(x, dim, comm, axis)
