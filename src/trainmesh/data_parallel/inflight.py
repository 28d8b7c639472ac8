"""Reductions in flight and the transient memory they hold.

Every strategy launches its reductions asynchronously and waits for them in launch order
(first in, first out: the same on every rank). :class:`Reductions` keeps that queue, bounds
how many transient buffers are in flight (``max_inflight``: the oldest is waited for when one
more would exceed it), and counts transient communication memory (buckets awaiting reduction,
cast copies, a ZeRO-3 unit's gathered parameters) into ``peak_bytes`` — the metrics'
``comm_buffer_peak_bytes``.

A reduce-scatter (:meth:`Reductions.reduce_scatter`) sums a buffer over the group ``axis`` and
leaves this rank's chunk; under HSDP (``replicate``: the ``dp_replicate`` group) that chunk is
then all-reduced across the replicas, which hold the same shard of different data, when it is
waited for. An all-reduce (:meth:`Reductions.all_reduce`, DDP) sums a whole bucket.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm, Handle
from ..comm.algorithms import all_reduce

Final = tuple[int, Any]
"""(group, index): ``grad_shards[group][index]`` is final for the step once a reduction lands."""


@dataclass
class Flight:
    """A reduction in flight: when done, ``out`` (a slice of ``buf`` or ``buf``) lands in ``dst``."""

    handle: Handle | None
    buf: torch.Tensor            # the collective's input
    out: torch.Tensor            # its output (this rank's chunk, or the whole bucket)
    dst: torch.Tensor            # where the reduced values belong (may be ``out`` itself)
    accumulate: bool             # add into dst (ZeRO-2/3, once per microbatch) or copy
    transient: bool              # ``buf`` is a transient buffer counted in comm memory
    replicate: bool = False      # HSDP: all-reduce ``out`` across replicas when it lands
    final: Final | None = None
    """``dst`` is final for the step once this lands (offload streams it to the host then)."""


class Reductions:
    """The FIFO of asynchronous reductions over ``axis`` (and ``replicate``) and the
    accounting of transient communication memory."""

    def __init__(self, comm: Comm, axis: str, device: torch.device, *,
                 replicate: str | None = None, max_inflight: int = 2) -> None:
        self.comm, self.axis, self.device = comm, axis, device
        self.replicate = replicate if replicate and comm.mesh.size(replicate) > 1 else None
        self.max_inflight = max_inflight
        self.world = comm.mesh.size(axis)
        self.rank = comm.mesh.index(axis)
        self.queue: list[Flight] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.on_final: Callable[[int, Any], None] | None = None
        """Called with ``Flight.final`` as a final reduction lands (offload: stream to host)."""
        self.eager = False
        """Complete reductions as soon as they have landed (offload: stream them early), where
        completing one issues no collective (no HSDP replicas)."""

    # ---------------------------------------------------------------- memory
    def count(self, nbytes: int) -> None:
        """``nbytes`` more transient memory is live."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed transient buffer (counted until the reduction that takes it lands)."""
        t = torch.zeros(numel, dtype=dtype, device=self.device)
        self.count(t.numel() * t.element_size())
        return t

    # ---------------------------------------------------------------- launching
    def reduce_scatter(self, buf: torch.Tensor, dst: torch.Tensor, *, accumulate: bool,
                       transient: bool, final: Final | None = None) -> None:
        """Reduce-scatter ``buf`` (world * chunk,) in place into this rank's chunk, async; the
        chunk then lands in ``dst`` (added or copied)."""
        chunk = buf.numel() // self.world
        out = buf[self.rank * chunk : (self.rank + 1) * chunk]
        handle = self.comm.reduce_scatter(out, buf, self.axis, async_op=True)
        self._push(Flight(handle, buf, out, dst, accumulate, transient,
                          self.replicate is not None, final))

    def all_reduce(self, buf: torch.Tensor, dst: torch.Tensor, *, algorithm: str = "native",
                   transient: bool) -> None:
        """All-reduce ``buf`` over the group, async; the sum then lands in ``dst`` (copied,
        unless ``buf`` is ``dst``)."""
        handle = all_reduce(self.comm, buf, self.axis, algorithm=algorithm, async_op=True)
        self._push(Flight(handle, buf, buf, dst, False, transient))

    def _push(self, flight: Flight) -> None:
        self.queue.append(flight)
        while sum(f.transient for f in self.queue) > self.max_inflight:   # bound the memory
            self._complete(self.queue.pop(0))
        if self.eager:
            self.settle()

    def settle(self) -> None:
        """Complete the oldest reductions that have landed (their buffers released now, not
        when the queue is full), where completing one issues no collective: a replicated
        shard's all-reduce (HSDP) must come at the same point of the program on every rank of
        its group, so a landed one keeps only its chunk (the group's buffer and the backend's
        copy of it released) until then."""
        while self.replicate is None and self.queue and self._landed(self.queue[0]):
            self._complete(self.queue.pop(0))
        for f in self.queue:      # HSDP: a landed chunk waits for its all-reduce on its own
            if f.replicate and f.transient and f.handle is not None and f.out is not f.buf and self._landed(f):
                f.handle.wait()
                f.handle, f.buf = None, f.out.clone()
                self.release(f.out.numel() * (self.world - 1) * f.out.element_size())
                f.out = f.buf

    def land(self) -> None:
        """Wait until every reduction in flight has landed, then :meth:`settle`: no collective
        is issued, so calling it at the same point on every rank keeps their collectives in
        the same order whatever landed first."""
        for f in self.queue:
            if f.handle is not None:
                f.handle.wait()
        self.settle()

    @staticmethod
    def _landed(f: Flight) -> bool:
        return f.handle is None or f.handle.is_completed()

    # ---------------------------------------------------------------- waiting
    def _complete(self, f: Flight) -> None:
        if f.handle is not None:
            f.handle.wait()
        if f.replicate:   # HSDP: the replicas' shards summed (in launch order on every rank)
            self.comm.all_reduce(f.out, self.replicate)
        same = f.out.data_ptr() == f.dst.data_ptr() and f.out.dtype == f.dst.dtype
        if f.accumulate:
            f.dst.add_(f.out.view_as(f.dst))
        elif not same:
            f.dst.copy_(f.out.view_as(f.dst))
        if f.final is not None and self.on_final is not None:
            self.on_final(*f.final)
        if f.transient:
            self.release(f.buf.numel() * f.buf.element_size())

    def drain(self) -> None:
        """Wait for every reduction in flight, oldest first."""
        while self.queue:
            self._complete(self.queue.pop(0))
