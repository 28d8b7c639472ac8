"""ZeRO-3's units and their residency: a unit's full parameters exist only around their use.

A :class:`Unit` (a module whose parameters are gathered, used and freed together) holds, per
optimizer group, one flat padded piece (:class:`Piece`) of which this rank keeps a chunk inside
the group's flat shard. It is also the bucket its gradients are counted in
(:class:`~.buckets.Bucket`: reduced once every parameter of the unit has its gradient).

:class:`Residency` gathers a unit (all_gather inside the strategy's group, in the gathered dtype:
FSDP2-style mixed precision; from the host under ``--offload-params``) and frees it. Freeing
resizes the storage of the unit's gathered buffer to zero (so tensors autograd saved, including
views of parameters, see the data again after the next gather) and points every ``param.data``
at an empty tensor (touching a freed parameter fails instead of reading freed memory). Before
each gather the ranks agree on which unit it is (:mod:`.agreement`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Comm, Handle
from .agreement import Agreements, Pending
from .buckets import Bucket
from .flat import FlatLayout
from .inflight import Reductions


class State(enum.Enum):
    FREE = 0
    GATHERING = 1
    GATHERED = 2


@dataclass
class Piece:
    """A unit's parameters of one optimizer group: one flat buffer, one all-gather."""

    group: int
    layout: FlatLayout        # a single bucket: padded = world * chunk
    offset: int               # where this piece starts in the unit's gathered buffer
    shard_start: int          # where this rank's chunk starts in the group's shard


@dataclass
class Unit(Bucket):
    """A ZeRO-3 unit (``params``: every parameter it owns, the bucket's members)."""

    name: str = ""
    module: nn.Module | None = None
    pieces: list[Piece] = field(default_factory=list)
    full: torch.Tensor | None = None                     # gathered params (storage freed when FREE)
    views: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    state: State = State.FREE
    handles: list[Handle | None] = field(default_factory=list)
    sends: list[torch.Tensor] = field(default_factory=list)
    agreement: Pending | None = None    # a prefetch's rows in flight
    done: bool = True         # its gradients were reduced in this microbatch's backward

    @property
    def nbytes(self) -> int:
        return self.full.numel() * self.full.element_size()


class Residency:
    """Gathers and frees ``units`` over the group ``axis``; ``shards`` are the groups' flat
    shards this rank keeps (transient memory counted in ``reductions``)."""

    def __init__(self, comm: Comm, axis: str, device: torch.device, reductions: Reductions,
                 units: list[Unit], shards: list[torch.Tensor]) -> None:
        self.comm, self.axis, self.device = comm, axis, device
        self.reductions, self.units, self.shards = reductions, units, shards
        self.world, self.rank = comm.mesh.size(axis), comm.mesh.index(axis)
        self.agreements = Agreements(comm, axis, device, units)

    def chunk(self, pc: Piece) -> torch.Tensor:
        """This rank's chunk of piece ``pc`` inside its group's shard."""
        return self.shards[pc.group][pc.shard_start : pc.shard_start + pc.layout.chunk]

    def gather(self, unit: Unit, *, wait: bool, agreed: bool = False) -> None:
        """Start gathering ``unit`` if it is free; with ``wait``, until its parameters are whole.
        A gather started without ``wait`` (a prefetch) or of the unit an agreed order predicts
        (``agreed``) agrees in flight (:mod:`.agreement`)."""
        if unit.state is State.FREE:
            unit.agreement = self.agreements.unit(unit, now=wait and not agreed)
            unit.full.untyped_storage().resize_(unit.nbytes)
            self.reductions.count(unit.nbytes)
            unit.handles, unit.sends = [], []
            for pc in unit.pieces:
                send = self.chunk(pc)
                if send.dtype != unit.full.dtype or send.device != unit.full.device:
                    # mixed precision: gather in the compute dtype; --offload-params: from the host
                    send = send.to(unit.full.device, unit.full.dtype, non_blocking=True)
                    unit.sends.append(send)
                    self.reductions.count(send.numel() * send.element_size())
                out = unit.full[pc.offset : pc.offset + pc.layout.padded]
                unit.handles.append(self.comm.all_gather(out, send, self.axis, async_op=True))
            unit.state = State.GATHERING
        if wait and unit.state is State.GATHERING:
            if unit.agreement is not None:
                pending, unit.agreement = unit.agreement, None
                self.agreements.check(pending)
            for h in unit.handles:
                if h is not None:
                    h.wait()
            for s in unit.sends:
                self.reductions.release(s.numel() * s.element_size())
            unit.handles, unit.sends = [], []
            for p, view in unit.views:
                p.data = view
            unit.state = State.GATHERED

    def free(self, unit: Unit) -> None:
        """Release ``unit``'s gathered parameters (after any gather in flight has landed)."""
        if unit.state is State.FREE:
            return
        self.gather(unit, wait=True)   # never free memory a collective is writing
        empty = torch.empty(0, dtype=unit.full.dtype, device=self.device)
        for p, _ in unit.views:
            p.data = empty
        unit.full.untyped_storage().resize_(0)
        self.reductions.release(unit.nbytes)
        unit.state = State.FREE
