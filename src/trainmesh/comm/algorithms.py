"""All-reduce algorithms built from the ledgered point-to-point ops of :class:`Comm`.

Each sums a tensor in place over the ranks of one mesh axis, exactly as the backend's
``all_reduce`` does (``native``), but every byte goes through ``Comm.batch_p2p`` and so lands in
the ledger as ``send``/``recv`` on that axis: what a rank really puts on the wire can be compared
with the theory below (S = payload bytes, N = ranks of the axis)::

    algorithm  steps          bytes sent by the busiest rank     total bytes sent
    naive      2              (N-1) S   (rank 0 answers everyone)   2 (N-1) S
    tree       2 ceil(log2 N) ceil(log2 N) S (the root's children) 2 (N-1) S
    ring       2 (N-1)        2 (N-1)/N S   (every rank alike)      2 (N-1) S

``naive``: every rank sends its tensor to the first rank of the axis, which sums and sends the
result back. ``tree``: a binomial tree; in round k (mask 2^k) a rank whose index has bit k set
sends its partial sum to index - 2^k and drops out; the root then broadcasts down the same
tree in reverse. ``ring``: the tensor is cut into N chunks (``tensor_split``: sizes differ by at
most one element when N does not divide it); N-1 reduce-scatter steps each pass one chunk to the
right neighbour, which adds it to its own copy, after which rank i holds the full sum of chunk
i+1; N-1 all-gather steps pass the finished chunks around. Every rank ends with bitwise the
same tensor (the reduced chunks are copied, not re-summed), though the summation order - and so
the fp32 rounding - differs from the backend's.

The algorithms run synchronously when called; an async caller gets a completed handle.
"""
from __future__ import annotations

import math

import torch

from .ops import Comm, Handle

ALGORITHMS = ("native", "ring", "tree", "naive")


def all_reduce(comm: Comm, t: torch.Tensor, axis: str, *, algorithm: str = "native",
               async_op: bool = False) -> Handle | None:
    """Sum ``t`` in place over ``axis`` with ``algorithm``; a handle when ``async_op``.

    The hand-built algorithms finish before returning (the handle is already complete).
    """
    if algorithm == "native":
        return comm.all_reduce(t, axis, async_op=async_op)
    if algorithm not in _IMPLS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    ranks = comm.mesh.ranks("world" if axis == "other" else axis)
    if len(ranks) > 1:
        if not t.is_contiguous():
            raise ValueError("all_reduce algorithms need a contiguous tensor")
        _IMPLS[algorithm](comm, t.view(-1), axis, ranks, ranks.index(comm.mesh.rank))
    return Handle(comm, None, axis, "all_reduce", 0.0) if async_op else None


def theory_sent_bytes(algorithm: str, size_bytes: int, n: int) -> float:
    """Bytes the busiest rank sends in one all-reduce of ``size_bytes`` over ``n`` ranks."""
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) / n * size_bytes
    if algorithm == "tree":
        return math.ceil(math.log2(n)) * size_bytes
    if algorithm == "naive":
        return (n - 1) * size_bytes
    raise ValueError(f"no traffic model for {algorithm!r} (the backend chooses its own)")


def _exchange(comm: Comm, axis: str, ops: list[tuple[str, torch.Tensor, int]]) -> None:
    """Post sends and receives together, wait for all (empty chunks are skipped on both sides)."""
    for handle in comm.batch_p2p([op for op in ops if op[1].numel() > 0], axis):
        handle.wait()


def _naive(comm: Comm, x: torch.Tensor, axis: str, ranks: list[int], me: int) -> None:
    root = ranks[0]
    if me != 0:
        _exchange(comm, axis, [("send", x, root)])
        _exchange(comm, axis, [("recv", x, root)])
        return
    incoming = [torch.empty_like(x) for _ in ranks[1:]]
    _exchange(comm, axis, [("recv", buf, peer) for buf, peer in zip(incoming, ranks[1:])])
    for buf in incoming:   # in rank order: one fixed summation order
        x.add_(buf)
    _exchange(comm, axis, [("send", x, peer) for peer in ranks[1:]])


def _tree(comm: Comm, x: torch.Tensor, axis: str, ranks: list[int], me: int) -> None:
    n, mask, children = len(ranks), 1, []
    buf = torch.empty_like(x)
    while mask < n:   # reduce towards index 0
        if me & mask:
            _exchange(comm, axis, [("send", x, ranks[me - mask])])
            break
        if me + mask < n:
            _exchange(comm, axis, [("recv", buf, ranks[me + mask])])
            x.add_(buf)
            children.append(me + mask)
        mask <<= 1
    if me != 0:   # receive the result from the parent this rank sent to
        _exchange(comm, axis, [("recv", x, ranks[me - (me & -me)])])
    for child in reversed(children):   # broadcast down: farthest subtree first
        _exchange(comm, axis, [("send", x, ranks[child])])


def _ring(comm: Comm, x: torch.Tensor, axis: str, ranks: list[int], me: int) -> None:
    n = len(ranks)
    chunks = list(torch.tensor_split(x, n))          # n views of (≈numel/n,)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):   # reduce-scatter: after it, chunk (me+1) % n is complete here
        send, recv = chunks[(me - s) % n], chunks[(me - s - 1) % n]
        incoming = buf[: recv.numel()]
        _exchange(comm, axis, [("send", send, right), ("recv", incoming, left)])
        recv.add_(incoming)
    for s in range(n - 1):   # all-gather: pass the finished chunks around
        send, recv = chunks[(me + 1 - s) % n], chunks[(me - s) % n]
        _exchange(comm, axis, [("send", send, right), ("recv", recv, left)])


_IMPLS = {"ring": _ring, "tree": _tree, "naive": _naive}

__all__ = ["ALGORITHMS", "all_reduce", "theory_sent_bytes"]
