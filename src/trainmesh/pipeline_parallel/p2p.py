"""Point-to-point traffic of a pipeline step, derived from the schedule's action lists.

Messages (``key = (kind, stage, microbatch)``):

* ``("act", s, i)``  the input activation of stage ``s`` (the output of ``s-1``), sent by the
  rank of ``s-1`` right after its forward ``F(s-1, i)``;
* ``("grad", s, i)`` the gradient of stage ``s``'s output (the input gradient of ``s+1``), sent
  by the rank of ``s+1`` right after its backward ``B(s+1, i)``.

Why no schedule can deadlock: sends are non-blocking and never waited on before the end of the
step; receives are posted non-blocking and waited on only when an action needs their data. A rank
therefore blocks only on data its producer sends when it reaches the producing action, so the
step runs iff the schedule's dependency graph is acyclic — exactly what ``analysis.simulate``
checks. Without message tags, each directed pair of ranks is one FIFO channel: the receiver posts
its receives in the *sender's* send order (known to every rank, since schedules are data),
keeping one receive posted ahead per channel (prefetch), so data lands while the rank computes.

Shapes: the first step with a new batch shape sends a small int64 header before the first
activation into each stage (the gradients' shapes are those of the activations). Later steps
reuse the learned shapes and send the payload only, so per-step traffic is exactly the
activations and gradients (docs/METRICS.md, ``comm_bytes_per_step``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainmesh.core.layout import Group
from ..comm import Comm, Handle
from .schedules import BACKWARD, BACKWARD_INPUT, FORWARD, Schedule

MsgKey = tuple[str, int, int]
"""("act" | "grad", stage, microbatch)."""
Shape = tuple[torch.Size, torch.dtype]

_HEADER_DIMS = 8
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


@dataclass(frozen=True)
class Message:
    """One tensor sent from pipeline rank ``src`` to ``dst`` (pipeline indices)."""

    key: MsgKey
    src: int
    dst: int
    header: bool
    """Preceded by a shape header (first activation into a stage, first step of a shape)."""


def plan_messages(schedule: Schedule, *, headers: bool) -> list[list[Message]]:
    """Per pipeline rank, its outgoing messages in send order."""
    out: list[list[Message]] = [[] for _ in range(schedule.pp)]
    for rank, acts in enumerate(schedule.actions):
        announced: set[int] = set()
        for a in acts:
            if a.kind == FORWARD and not schedule.is_last_stage(a.stage):
                s = a.stage + 1
                out[rank].append(Message(("act", s, a.microbatch), rank, schedule.stage_to_rank(s),
                                         headers and s not in announced))
                announced.add(s)
            elif a.kind in (BACKWARD, BACKWARD_INPUT) and a.stage > 0:
                s = a.stage - 1
                out[rank].append(Message(("grad", s, a.microbatch), rank,
                                         schedule.stage_to_rank(s), False))
    return out


def encode_header(t: torch.Tensor) -> torch.Tensor:
    """(ndim, dtype code, dims...) as int64, fixed length."""
    if t.dim() > _HEADER_DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"pipeline boundary tensor {tuple(t.shape)} {t.dtype} cannot be sent: "
                         f"at most {_HEADER_DIMS} dims and one of {_DTYPES}")
    dims = list(t.shape) + [0] * (_HEADER_DIMS - t.dim())
    return torch.tensor([t.dim(), _DTYPES.index(t.dtype), *dims], dtype=torch.int64)


def decode_header(h: torch.Tensor) -> Shape:
    vals = h.tolist()
    return torch.Size(vals[2 : 2 + vals[0]]), _DTYPES[vals[1]]


def _finished(h: Handle) -> bool:
    """Non-blocking completion test of an async op."""
    return h.is_completed()


@dataclass
class _Channel:
    """Receives from one peer, posted strictly in the peer's send order."""

    peer: int                                   # global rank
    msgs: list[Message]
    next: int = 0                               # index of the next message to post
    header: tuple[torch.Tensor, Handle] | None = None
    posted: dict[MsgKey, tuple[torch.Tensor, Handle]] = field(default_factory=dict)


class StageP2P:
    """Sends and receives of one pipeline rank during a step (see the module docstring)."""

    def __init__(self, comm: Comm, schedule: Schedule, rank: int, peers: list[int],
                 device: torch.device, *, prefetch: int = 1) -> None:
        self.comm, self.schedule, self.rank, self.peers = comm, schedule, rank, peers
        self.device, self.depth = device, prefetch
        self._known: dict[tuple, dict[int, Shape]] = {}   # batch key -> {stage: input shape}
        self._plans = {h: plan_messages(schedule, headers=h) for h in (False, True)}
        self.shapes: dict[int, Shape] = {}
        self._sends: list[tuple[torch.Tensor, Handle]] = []

    # ---------------------------------------------------------------- step
    def begin(self, batch_key: tuple) -> None:
        """Start a step whose microbatches have shape ``batch_key`` (the same on every rank)."""
        fresh = batch_key not in self._known
        self.shapes = self._known.setdefault(batch_key, {})
        plan = self._plans[fresh]
        self._out = list(plan[self.rank])
        self._out_pos = 0
        self._channels: dict[int, _Channel] = {}
        self._channel_of: dict[MsgKey, _Channel] = {}
        for src in range(self.schedule.pp):
            mine = [m for m in plan[src] if m.dst == self.rank]
            if mine:
                ch = _Channel(self.peers[src], mine)
                self._channels[src] = ch
                self._channel_of.update((m.key, ch) for m in mine)
        self.prefetch()

    def finish(self) -> None:
        """Wait for every send of the step; check nothing was left unreceived."""
        for _, h in self._sends:
            h.wait()
        self._sends.clear()
        left = [m.key for ch in self._channels.values() for m in ch.msgs[ch.next:]]
        left += [k for ch in self._channels.values() for k in ch.posted]
        if left or self._out_pos != len(self._out):
            raise RuntimeError(f"pipeline rank {self.rank}: step ended with messages pending: "
                               f"receives {left[:4]}, sends {len(self._out) - self._out_pos}")

    # ---------------------------------------------------------------- shapes
    def shape_of(self, key: MsgKey) -> Shape | None:
        kind, stage, _ = key
        return self.shapes.get(stage if kind == "act" else stage + 1)

    # ---------------------------------------------------------------- sends
    def send(self, key: MsgKey, t: torch.Tensor) -> None:
        """Non-blocking send of message ``key`` (must be this rank's next planned send)."""
        msg = self._out[self._out_pos] if self._out_pos < len(self._out) else None
        if msg is None or msg.key != key:
            raise RuntimeError(f"pipeline rank {self.rank}: sending {key}, planned "
                               f"{msg.key if msg else 'nothing'}")
        self._out_pos += 1
        t = t.detach().contiguous()
        if key[0] == "act":
            self.shapes[key[1]] = (t.shape, t.dtype)
        ops = [("send", t, self.peers[msg.dst])]
        if msg.header:
            ops.insert(0, ("send", encode_header(t).to(self.device), self.peers[msg.dst]))
        handles = self.comm.batch_p2p(ops, axis=Group.pp)
        self._sends += [(tensor, h) for (_, tensor, _), h in zip(ops, handles)]
        self._sends = [(x, h) for x, h in self._sends if not _finished(h)]

    # ---------------------------------------------------------------- receives
    def prefetch(self) -> None:
        """Post up to ``depth`` receives ahead on every channel, without blocking."""
        for ch in self._channels.values():
            while len(ch.posted) < self.depth and ch.next < len(ch.msgs):
                if not self._post_next(ch, block=False):
                    break

    def take(self, key: MsgKey) -> torch.Tensor:
        """Wait for message ``key`` and return its buffer (a fresh tensor)."""
        ch = self._channel_of.get(key)
        if ch is None:
            raise RuntimeError(f"pipeline rank {self.rank}: no message {key} is planned for it")
        while key not in ch.posted:
            self._post_next(ch, block=True)
        buf, h = ch.posted.pop(key)
        h.wait()
        while len(ch.posted) < self.depth and ch.next < len(ch.msgs):
            if not self._post_next(ch, block=False):
                break
        return buf

    def _post_next(self, ch: _Channel, *, block: bool) -> bool:
        """Post the receive of ``ch``'s next message; False if that would have to wait."""
        msg = ch.msgs[ch.next]
        if msg.header:
            if ch.header is None:
                hdr = torch.empty(2 + _HEADER_DIMS, dtype=torch.int64, device=self.device)
                ch.header = (hdr, self.comm.irecv(hdr, ch.peer, axis=Group.pp))
            if not block and not _finished(ch.header[1]):
                return False
            hdr, h = ch.header
            h.wait()
            ch.header = None
            self.shapes[msg.key[1]] = decode_header(hdr.cpu())
            msg = Message(msg.key, msg.src, msg.dst, False)
            ch.msgs[ch.next] = msg
        shape = self.shape_of(msg.key)
        if shape is None:
            if block:
                raise RuntimeError(f"pipeline rank {self.rank}: shape of {msg.key} unknown")
            return False
        buf = torch.empty(shape[0], dtype=shape[1], device=self.device)
        ch.posted[msg.key] = (buf, self.comm.irecv(buf, ch.peer, axis=Group.pp))
        ch.next += 1
        return True
