"""Collective-order checking (``TRAINMESH_CHECK_COLLECTIVES=1``): every rank issues the same
collectives in the same order.

Each collective a rank issues through :class:`~trainmesh.comm.Comm` is noted as a signature
(op, axis, the group's ranks, dtype, shape). At each step's end (``Comm.end_step``) the ranks
compare what they issued since the previous check. Two ranks ``r`` and ``j`` must have issued
the same sequence of collectives on the groups they share; so rank ``r`` hashes, for every
rank ``j``, its own sequence on the groups that contain ``j``, and one all-gather of these
``world`` 8-byte digests lets every rank check every pair (``digest[r][j] == digest[j][r]``).
Only on a mismatch are the sequences themselves gathered, and the check fails on every rank
with :class:`CollectiveOrderError` naming the first collective that differs and the ranks.

Point-to-point ops are not compared: a sender and its receiver legitimately issue them in
different orders (asynchronous pipeline sends and receives). The check's own all-gather is not
booked in the ledger's per-step traffic.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

CHECK_ENV = "TRAINMESH_CHECK_COLLECTIVES"

Signature = tuple[str, str, tuple[int, ...], str, tuple[int, ...]]
"""(op, axis, ranks of the group, dtype, shape) of one collective."""


class CollectiveOrderError(RuntimeError):
    """Ranks issued different collectives, or the same ones in a different order."""


def enabled() -> bool:
    """Whether ``TRAINMESH_CHECK_COLLECTIVES=1`` asks for the check."""
    return os.environ.get(CHECK_ENV, "0") == "1"


def describe(sig: Signature) -> str:
    op, axis, ranks, dtype, shape = sig
    return f"{op}@{axis}[ranks {','.join(map(str, ranks))}] {dtype}{tuple(shape)}"


def _digest(sigs: list[Signature]) -> int:
    """A digest of a sequence that is the same in every process (Python's hash is not)."""
    raw = hashlib.blake2b(repr(sigs).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def shared(sigs: list[Signature], peer: int) -> list[Signature]:
    """The collectives in ``sigs`` on groups that contain ``peer``, in issue order."""
    return [s for s in sigs if peer in s[2]]


def first_difference(histories: dict[int, list[Signature]]) -> tuple[int, int, int, str, str] | None:
    """(rank r, rank j, index, what r issued, what j issued) of the first pair of ranks (in rank
    order) whose sequences on their shared groups differ; None when every pair agrees."""
    ranks = sorted(histories)
    for r in ranks:
        for j in ranks:
            if j <= r:
                continue
            a, b = shared(histories[r], j), shared(histories[j], r)
            if a == b:
                continue
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            what = [describe(s[i]) if i < len(s) else "nothing more" for s in (a, b)]
            return r, j, i, what[0], what[1]
    return None


@dataclass
class OrderCheck:
    """The signatures this rank issued since the last check, and the check itself."""

    rank: int
    world_size: int
    group: Any = None
    """The group spanning the world (None: the default group)."""
    issued: list[Signature] = field(default_factory=list)
    checks: int = 0
    """Checks done so far in this process (one per step)."""
    _ranks_of: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def note(self, op: str, axis: str, group: Any, t: torch.Tensor | None) -> None:
        """Record one collective on ``group`` (None: the world)."""
        key = id(group)
        ranks = self._ranks_of.get(key)
        if ranks is None:
            members = dist.get_process_group_ranks(group) if group is not None else range(self.world_size)
            ranks = self._ranks_of[key] = tuple(sorted(members))
        dtype = str(t.dtype).removeprefix("torch.") if t is not None else "object"
        self.issued.append((op, axis, ranks, dtype, tuple(t.shape) if t is not None else ()))

    def verify(self) -> None:
        """Collective over the world: compare and reset; raise CollectiveOrderError on a mismatch."""
        self.checks += 1
        issued, self.issued = self.issued, []
        if self.world_size == 1:
            return
        mine = torch.tensor([_digest(shared(issued, j)) for j in range(self.world_size)], dtype=torch.int64)
        table = torch.empty(self.world_size * self.world_size, dtype=torch.int64)
        dist.all_gather_into_tensor(table, mine, group=self.group)
        table = table.view(self.world_size, self.world_size)   # (rank r, peer j)
        if torch.equal(table, table.T):
            return
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, issued, group=self.group)
        found = first_difference(dict(enumerate(gathered)))
        if found is None:   # digests differ, sequences agree: cannot happen short of a hash bug
            return
        r, j, i, a, b = found
        raise CollectiveOrderError(
            f"rank {j} and rank {r} issued different collectives: at collective #{i + 1} on the "
            f"groups they share, in step {self.checks} of this process, rank {r} ran {a} while "
            f"rank {j} ran {b} ({CHECK_ENV}=1)")
