"""Comm: every collective and point-to-point op trainmesh issues, through one ledger.

Ops take the mesh axis ("dp", "tp", "pp", or "world" for the whole world) by name, so the
ledger can key traffic by axis ("other", the world's name in the metrics file, is accepted
too); ``group=`` overrides the process group while keeping the axis label (e.g. the group of
the pipeline ranks sharing a tied weight, from ``mesh.subgroups``). Groups of size one are a
no-op. Object gathers (checkpoint manifests, timelines, summaries) go through here too.
Every op carries the mesh's timeout (set on the process groups and on every ``wait``).
"""
from __future__ import annotations

import socket
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.core.errors import CommTimeout
from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh

from .check import OrderCheck
from .check import enabled as order_check_enabled
from .diagnose import EXCHANGE_WAIT_S, exchange, hosts_of, silent_ranks, verdict
from .ledger import Ledger, Span, canonical_axis

ReduceOp = dist.ReduceOp
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Handle:
    """An async op in flight; ``wait()`` blocks (with the timeout) and books the waiting time."""

    def __init__(self, comm: "Comm", work: Any, axis: str, op: str, started: float,
                 span: Span | None = None) -> None:
        self._comm, self._work, self.axis, self.op, self._started = comm, work, axis, op, started
        self.done = work is None
        self._span = span

    def is_completed(self) -> bool:
        """Whether the op has finished (without waiting)."""
        finished = self.done or self._work is None or bool(self._work.is_completed())
        if finished and self._span is not None and self._span.end is None:
            self._span.end = time.perf_counter()
        return finished

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        try:
            ok = self._work.wait(timedelta(seconds=self._comm.timeout_s))
        except RuntimeError as exc:
            raise self._comm.failure(self.op, self.axis, exc) from exc
        if ok is False:
            raise self._comm.failure(self.op, self.axis, TimeoutError(f"timed out after {self._comm.timeout_s}s"))
        now = time.perf_counter()
        self._comm.ledger.add_seconds(self.axis, self.op, now - t0)
        if self._span is not None and self._span.end is None:
            self._span.end = now
        self.done = True


COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "scatter",
               "gather", "all_to_all", "all_to_all_v", "barrier", "all_gather_object", "send",
               "recv", "isend", "irecv", "batch_p2p")
"""The :class:`Comm` methods that talk to other ranks."""


class Comm:
    """The communication layer of one mesh: ops by axis name, each recorded in ``ledger``."""

    def __init__(self, mesh: ParallelMesh, ledger: Ledger | None = None, *, history: int = 32) -> None:
        self.mesh = mesh
        self.ledger = ledger if ledger is not None else Ledger()
        self.timeout_s = mesh.timeout_s
        self.seq = 0
        self.recent: deque[tuple[int, str, str, tuple[int, ...]]] = deque(maxlen=history)
        self.order_check = (OrderCheck(mesh.rank, mesh.world_size, mesh.group(Group.world))
                            if order_check_enabled() else None)
        """Set with ``TRAINMESH_CHECK_COLLECTIVES=1``: the ranks compare their collectives at
        each :meth:`end_step` (:mod:`trainmesh.comm.check`)."""

    def end_step(self) -> dict:
        """Close the ledger's step window (returns its table); with the order check on, the
        ranks then compare the collectives they issued since the last check."""
        window = self.ledger.end_step()
        if self.order_check is not None:
            self.order_check.verify()
        return window

    # ---------------------------------------------------------------- plumbing
    def _group(self, axis: str, group: Any) -> Any:
        if group is not None:
            return group
        return self.mesh.group(canonical_axis(axis))

    def _size(self, axis: str, group: Any) -> int:
        if group is not None:
            return dist.get_world_size(group)
        return self.mesh.size(canonical_axis(axis))

    def failure(self, op: str, axis: str, exc: BaseException) -> Exception:
        """An error naming the suspect, this rank, the op, and who diverged where (hang diagnosis).

        The message starts with the rank that stopped answering when some rank sent no history
        (the launcher prints its first line as the headline), else with this rank."""
        history = [(s, o, a, tuple(shape)) for s, o, a, shape in self.recent]
        world = self.mesh.world_size
        seen = exchange(self.mesh.rank, world, history, wait_s=min(EXCHANGE_WAIT_S, self.timeout_s / 2))
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        silent = silent_ranks(seen, world)
        hosts = hosts_of(silent) if silent else {}
        who = ", ".join(f"{r} on {hosts[r]}" if r in hosts else str(r) for r in silent)
        head = f"rank{'s' if len(silent) > 1 else ''} {who} stopped answering: " if silent else ""
        return CommTimeout(f"{head}rank {self.mesh.rank} on {socket.gethostname()}: {op} on {axis} "
                           f"failed (op #{self.seq}): "
                           f"{first_line[:300]}; diagnosis: {verdict(seen, world)}")

    def _run(self, op: str, axis: str, payload: int, fn, shape: tuple[int, ...],
             async_op: bool, *, collective: tuple[Any, torch.Tensor] | None = None) -> Handle | None:
        """Issue ``fn``; ``collective`` = (its group, its tensor) for the order check."""
        if collective is not None and self.order_check is not None:
            self.order_check.note(op, canonical_axis(axis), *collective)
        self.seq += 1
        self.recent.append((self.seq, op, axis, shape))
        self.ledger.record(axis, op, payload)
        started = time.perf_counter()
        span = self.ledger.open_span(axis, op, payload, started)
        try:
            work = fn(async_op)
        except RuntimeError as exc:
            raise self.failure(op, axis, exc) from exc
        self.ledger.add_seconds(axis, op, time.perf_counter() - started)
        handle = Handle(self, work, axis, op, started, span)
        if async_op:
            return handle
        handle.wait()
        return None

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, t: torch.Tensor, axis: str, *, op=ReduceOp.SUM, group=None,
                   async_op: bool = False) -> Handle | None:
        """In place: every rank gets the reduction of ``t`` over the group."""
        if self._size(axis, group) == 1:
            return Handle(self, None, axis, "all_reduce", 0.0) if async_op else None
        g = self._group(axis, group)
        return self._run("all_reduce", axis, nbytes(t),
                         lambda a: dist.all_reduce(t, op=op, group=g, async_op=a), t.shape, async_op,
                         collective=(g, t))

    def broadcast(self, t: torch.Tensor, axis: str, *, src: int, group=None,
                  async_op: bool = False) -> Handle | None:
        """In place from global rank ``src`` to every rank of the group."""
        if self._size(axis, group) == 1:
            return None
        g = self._group(axis, group)
        return self._run("broadcast", axis, nbytes(t),
                         lambda a: dist.broadcast(t, src=src, group=g, async_op=a), t.shape, async_op,
                         collective=(g, t))

    def reduce(self, t: torch.Tensor, axis: str, *, dst: int, op=ReduceOp.SUM, group=None,
               async_op: bool = False) -> Handle | None:
        """In place on global rank ``dst``: the reduction of ``t`` over the group."""
        if self._size(axis, group) == 1:
            return None
        g = self._group(axis, group)
        return self._run("reduce", axis, nbytes(t),
                         lambda a: dist.reduce(t, dst=dst, op=op, group=g, async_op=a), t.shape, async_op,
                         collective=(g, t))

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, axis: str, *, group=None,
                   async_op: bool = False) -> Handle | None:
        """``out`` (n * t.numel(), rank-major) <- every rank's ``t``."""
        n = self._size(axis, group)
        if out.numel() != n * t.numel():
            raise ValueError(f"all_gather: output has {out.numel()} elements, need {n} x {t.numel()}")
        if n == 1:
            out.view(-1).copy_(t.view(-1))
            return None
        g = self._group(axis, group)
        return self._run("all_gather", axis, nbytes(out),
                         lambda a: _ALL_GATHER(out, t, group=g, async_op=a), out.shape, async_op,
                         collective=(g, t))

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, axis: str, *, op=ReduceOp.SUM,
                       group=None, async_op: bool = False) -> Handle | None:
        """``out`` <- this rank's 1/n chunk of the reduction of ``t`` over the group."""
        n = self._size(axis, group)
        if t.numel() != n * out.numel():
            raise ValueError(f"reduce_scatter: input has {t.numel()} elements, need {n} x {out.numel()}")
        if n == 1:
            out.view(-1).copy_(t.view(-1))
            return None
        g = self._group(axis, group)
        return self._run("reduce_scatter", axis, nbytes(t),
                         lambda a: _REDUCE_SCATTER(out, t, op=op, group=g, async_op=a), t.shape, async_op,
                         collective=(g, t))

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None, axis: str, *, src: int,
                group=None) -> None:
        """``out`` <- chunk i of global rank ``src``'s list, on the i-th rank of the group."""
        n = self._size(axis, group)
        if n == 1:
            out.copy_(chunks[0])  # type: ignore[index]
            return None
        g = self._group(axis, group)
        self._run("scatter", axis, nbytes(out) * n,
                  lambda a: dist.scatter(out, chunks, src=src, group=g, async_op=a), out.shape, False,
                  collective=(g, out))
        return None

    def gather(self, t: torch.Tensor, chunks: list[torch.Tensor] | None, axis: str, *, dst: int,
               group=None) -> None:
        """On global rank ``dst``, ``chunks[i]`` <- the i-th rank's ``t``."""
        n = self._size(axis, group)
        if n == 1:
            chunks[0].copy_(t)  # type: ignore[index]
            return None
        g = self._group(axis, group)
        self._run("gather", axis, nbytes(t) * n,
                  lambda a: dist.gather(t, chunks, dst=dst, group=g, async_op=a), t.shape, False,
                  collective=(g, t))
        return None

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, axis: str, *, group=None,
                   async_op: bool = False) -> Handle | None:
        """Rank i's chunk j goes to rank j's chunk i (equal chunks along dim 0)."""
        if self._size(axis, group) == 1:
            out.copy_(t)
            return None
        g = self._group(axis, group)
        return self._run("all_to_all", axis, nbytes(t),
                         lambda a: dist.all_to_all_single(out, t, group=g, async_op=a), t.shape, async_op,
                         collective=(g, t))

    def all_to_all_v(self, out: torch.Tensor, t: torch.Tensor, axis: str, *, out_splits: list[int],
                     in_splits: list[int], group=None) -> None:
        """Variable sizes along dim 0: rank i's ``in_splits[j]`` rows go to rank j, which receives
        them as its ``out_splits[i]`` rows (both ranks must agree: exchange the sizes first).
        Recorded as op ``all_to_all``, the bytes of ``t`` (what this rank sends, its own share
        included)."""
        if self._size(axis, group) == 1:
            out.copy_(t)
            return None
        g = self._group(axis, group)
        self._run("all_to_all", axis, nbytes(t),
                  lambda a: dist.all_to_all_single(out, t, output_split_sizes=out_splits,
                                                   input_split_sizes=in_splits, group=g, async_op=a),
                  t.shape, False, collective=(g, None))
        return None

    def barrier(self, axis: str = "world", *, group=None) -> None:
        if self._size(axis, group) == 1:
            return
        g = self._group(axis, group)
        self._run("barrier", axis, 0, lambda a: dist.barrier(group=g, async_op=a), (), False,
                  collective=(g, None))

    def all_gather_object(self, obj: Any, axis: str = "world") -> list[Any]:
        """Every rank's picklable ``obj``, in group order (metadata, never tensors of a step)."""
        n = self._size(axis, None)
        if n == 1:
            return [obj]
        out: list[Any] = [None] * n
        group = self._group(axis, None)
        if self.order_check is not None:
            self.order_check.note("all_gather_object", canonical_axis(axis), group, None)
        self.seq += 1
        self.recent.append((self.seq, "all_gather_object", axis, ()))
        started = time.perf_counter()
        try:
            dist.all_gather_object(out, obj, group=group)
        except RuntimeError as exc:
            raise self.failure("all_gather_object", axis, exc) from exc
        self.ledger.record(axis, "all_gather_object", 0, time.perf_counter() - started)
        return out

    # ---------------------------------------------------------------- point to point
    def send(self, t: torch.Tensor, dst: int, axis: str = "pp") -> None:
        """Blocking send of ``t`` to global rank ``dst``."""
        self._run("send", axis, nbytes(t), lambda a: dist.isend(t, dst), t.shape, False)

    def recv(self, t: torch.Tensor, src: int, axis: str = "pp") -> None:
        """Blocking receive into ``t`` from global rank ``src``."""
        self._run("recv", axis, nbytes(t), lambda a: dist.irecv(t, src), t.shape, False)

    def isend(self, t: torch.Tensor, dst: int, axis: str = "pp") -> Handle:
        return self._run("send", axis, nbytes(t), lambda a: dist.isend(t, dst), t.shape, True)  # type: ignore[return-value]

    def irecv(self, t: torch.Tensor, src: int, axis: str = "pp") -> Handle:
        return self._run("recv", axis, nbytes(t), lambda a: dist.irecv(t, src), t.shape, True)  # type: ignore[return-value]

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int]], axis: str = "pp") -> list[Handle]:
        """Issue a batch of ("send"|"recv", tensor, peer) together; returns one handle each."""
        if not ops:
            return []
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer) for kind, t, peer in ops]
        for kind, t, _ in ops:
            self.seq += 1
            self.recent.append((self.seq, kind, axis, tuple(t.shape)))
            self.ledger.record(axis, kind, nbytes(t))
        started = time.perf_counter()
        spans = [self.ledger.open_span(axis, kind, nbytes(t), started) for kind, t, _ in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as exc:
            raise self.failure("batch_p2p", axis, exc) from exc
        return [Handle(self, w, axis, kind, started, span)
                for w, (kind, _, _), span in zip(works, ops, spans)]
