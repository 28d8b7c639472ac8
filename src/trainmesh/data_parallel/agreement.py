"""ZeRO-3's DP ranks agree on what they gather, so a module run on some ranks only is named.

A unit's all-gather whose peers gather another unit, of another size, aborts the backend (gloo:
SIGABRT) instead of raising; and two units of one size would silently swap parameters. So each
gather is preceded, on every rank, by one all-gather of a fixed-size row saying what it is about
(:data:`UNIT` and the unit's index), and each backward by one row fingerprinting the forward's
order (:data:`ORDER`). Rows all have one size, so whatever two ranks are doing their rows pair,
and every rank reads the same table: either all go on or all raise, naming each rank's unit.

A gather the rank needs now, of a unit no agreed order predicts there, checks its row at once
(a blocking round trip). Every other gather — a prefetch, or the unit the agreed order names at
this point (the first of a forward or of a backward) — sends its row with its own gather and
checks it when the gather is waited for. Such a gather never pairs with another size: every
rank takes it from the same agreed order (the backward from its own forward's, the next forward
from the previous one: :meth:`Agreements.order`), so two of them pair only with the same unit,
and where one pairs with a peer's unpredicted gather, that peer's row pairs with its row and the
peer raises before sending anything. Per backward, the order's row is the one round trip.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..comm import Comm, Handle


class Unit(Protocol):
    """What a row names (a :class:`~.residency.Unit`)."""

    index: int
    name: str


UNIT, ORDER = 0, 1
"""What a rank's row is about: gathering a unit (its index), or the end of a forward (its order)."""

_WIDTH = 4
_ADVICE = ("a module ran on some ranks and not on others. Every DP rank must run the same modules "
           "in the same order; run the module on every rank (e.g. with a zero-weighted "
           "contribution) or put it inside a unit that always runs (zero3_units=)")


@dataclass
class Pending:
    """Rows in flight: every rank's, checked when the gather they go with is waited for."""

    handle: Handle | None
    table: torch.Tensor          # (world, 4) int64
    mine: list[int]


class Agreements:
    """The rows over the group ``axis`` of the ranks gathering ``units``."""

    def __init__(self, comm: Comm, axis: str, device: torch.device, units: Sequence[Unit]) -> None:
        self.comm, self.axis, self.device, self.units = comm, axis, device, units
        self.world, self.rank = comm.mesh.size(axis), comm.mesh.index(axis)

    def _rows(self, mine: list[int], *, now: bool) -> Pending:
        table = torch.zeros(self.world, _WIDTH, dtype=torch.int64, device=self.device)
        row = torch.tensor(mine, dtype=torch.int64, device=self.device)
        handle = self.comm.all_gather(table.view(-1), row, self.axis, async_op=not now)
        return Pending(handle, table, mine)

    def unit(self, unit: Unit, *, now: bool) -> Pending | None:
        """Before ``unit``'s gather: checked at once (``now``), else returned to :meth:`check`."""
        if self.world == 1:
            return None
        pending = self._rows([UNIT, unit.index, 0, 0], now=now)
        if now:
            self.check(pending)
            return None
        return pending

    def _differ(self, pending: Pending) -> list[list[int]] | None:
        """Every rank's row once landed (on the host: the table may be on an accelerator), or
        None where every row equals this rank's."""
        if pending.handle is not None:
            pending.handle.wait()
        rows = pending.table.tolist()
        return None if all(row == pending.mine for row in rows) else rows

    def check(self, pending: Pending) -> None:
        """Raise, naming what every rank is at, unless every row equals this rank's."""
        rows = self._differ(pending)
        if rows is not None:
            at = ", ".join(f"dp rank {r}: {self._what(row)}" for r, row in enumerate(rows))
            raise RuntimeError(f"ZeRO-3: the DP ranks gather different units ({at}): {_ADVICE}")

    def order(self, fwd: list[Unit], post: list[Unit]) -> None:
        """At a backward's start: every rank ran the same units in forward, in the same order
        (a fingerprint of the pre- and post-forward orders; on a mismatch every rank's order,
        gathered, is named)."""
        if self.world == 1:
            return
        h = 0
        for i in [*(u.index for u in fwd), -1, *(u.index for u in post)]:
            h = (h * 1_000_003 + i + 2) % (2**61 - 1)
        pending = self._rows([ORDER, len(fwd), len(post), h], now=True)
        rows = self._differ(pending)
        if rows is None:
            return
        if any(row[0] != ORDER for row in rows):   # a peer is gathering a unit: name it
            self.check(pending)
        orders = self.comm.all_gather_object([self._name(u) for u in fwd], self.axis)
        ran = "; ".join(f"dp rank {r}: {', '.join(o)}" for r, o in enumerate(orders))
        raise RuntimeError(f"ZeRO-3: the DP ranks ran different units in forward ({ran}): {_ADVICE}")

    def _name(self, unit: Unit) -> str:
        return repr(unit.name or "<root>")

    def _what(self, row: list[int]) -> str:
        if row[0] == UNIT and 0 <= row[1] < len(self.units):
            return self._name(self.units[row[1]])
        return f"the end of its forward, {row[1]} units run"
