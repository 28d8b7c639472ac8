"""Test-only fault injection: ``TRAINMESH_FT_INJECT`` makes chosen replicas fail on cue.

The value is a comma-separated list of ``R@K:POINT`` entries (``R.I@K:POINT`` for replica R's
incarnation I, its I-th restart; I is 0 by default; ``R/J...`` for rank J of a replica of
several ranks, 0 by default): at step K, replica R (its rank J)

- ``reduce`` (the default when ``:POINT`` is left out): SIGKILLs itself after its forward and
  backward, just before the gradient all-reduce (its peers are in the collective);
- ``send``: SIGKILLs itself as the source of a state transfer, before sending (a failure during
  recovery);
- ``fail``: raises an error in place of its all-reduce across replicas, alive (a collective that
  fails on one rank of a replica and not on its peers; once: the redo of step K goes through);
- ``recv``: SIGKILLs itself as a receiver of a state transfer, before receiving (a failure
  during its own recovery);
- ``hold``: before asking into the first quorum of step K, waits until every other replica has
  asked into it (at most :data:`HOLD_S`), so that a restarting replica rejoins at step K whatever
  the machine's speed (once: a redo of step K does not wait again);
- ``join``: (a restarted incarnation, ``R.I@K:join`` with I >= 1) asks back in no earlier than
  the quorum of step K, so that a restart faster than the steps does not rejoin early;
- ``report``: SIGKILLs itself after its all-reduce across replicas went through, before
  reporting its outcome (the others' attempts succeeded, the step is discarded);
- ``late``: after reporting its outcome of step K, waits until the coordinator is gone (at most
  :data:`HOLD_S`) before reading the commit (the others may have read and applied it);
- ``pause``: just before its sums across replicas, stops beating and sleeps :data:`PAUSE_S`,
  its connections open (a partition, as the others see it: silent, not gone).

``coordinator@K`` makes the coordinator SIGKILL itself once it committed step K and a replica
asked into the next quorum (that replica applied step K).

Never set it outside tests.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from .protocol import INJECT_ENV, POLL_S

POINTS = ("reduce", "fail", "send", "recv", "hold", "join", "report", "late", "commit", "pause")
PAUSE_S = 4.0
"""Twice the heartbeat timeout: the others drop the replica and go on before it returns."""
COORDINATOR = -1
"""The replica field of ``coordinator@K`` entries."""
HOLD_S = 120.0


def parse(value: str) -> list[tuple[int, int, int, str, int]]:
    """``(replica, incarnation, step, point, rank)`` entries of an injection string."""
    out = []
    for item in filter(None, (s.strip() for s in value.split(","))):
        where, _, point = item.partition(":")
        who, _, step = where.partition("@")
        who, _, incarnation = who.partition(".")
        replica, _, rank = who.partition("/")
        if replica == "coordinator":
            replica, point = str(COORDINATOR), point or "commit"
        if (point or "reduce") not in POINTS:
            raise ValueError(f"{INJECT_ENV}: unknown point {point!r} in {item!r} ({', '.join(POINTS)})")
        out.append((int(replica), int(incarnation or 0), int(step), point or "reduce", int(rank or 0)))
    return out


class Injector:
    """Where this rank of a replica's incarnation is to fail, from the environment (nowhere by
    default)."""

    def __init__(self, replica: int, incarnation: int, value: str | None = None, *,
                 rank: int = 0) -> None:
        value = os.environ.get(INJECT_ENV, "") if value is None else value
        self.at = {(step, point) for r, i, step, point, j in parse(value)
                   if (r, i, j) == (replica, incarnation, rank)}

    def maybe_die(self, step: int, point: str) -> None:
        if (step, point) in self.at:
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_fail(self, step: int) -> None:
        if (step, "fail") in self.at:
            self.at.discard((step, "fail"))
            raise RuntimeError(f"{INJECT_ENV}: injected failure of the all-reduce of step {step}")

    def maybe_hold(self, step: int, everyone_asked: Callable[[], bool]) -> None:
        if (step, "hold") in self.at:
            self.at.discard((step, "hold"))
            deadline = time.monotonic() + HOLD_S
            while not everyone_asked() and time.monotonic() < deadline:
                time.sleep(POLL_S)

    def maybe_pause(self, step: int, silence: Callable[[float], None]) -> None:
        """``pause``: ``silence(seconds)`` stops the heartbeat; then sleep as long."""
        if (step, "pause") in self.at:
            self.at.discard((step, "pause"))
            silence(PAUSE_S)
            time.sleep(PAUSE_S)

    def maybe_wait_until(self, step: int, point: str, condition: Callable[[], bool]) -> bool:
        """``late`` (and the coordinator's ``commit``): wait until ``condition()`` (bounded);
        whether this was the point."""
        if (step, point) in self.at:
            self.at.discard((step, point))
            deadline = time.monotonic() + HOLD_S
            while not condition() and time.monotonic() < deadline:
                time.sleep(POLL_S)
            return True
        return False

    def maybe_wait_to_join(self, next_step: Callable[[], int]) -> None:
        """``join``: wait until the quorum being collected is that of the given step (bounded)."""
        steps = [step for step, point in self.at if point == "join"]
        if steps:
            deadline = time.monotonic() + HOLD_S
            while next_step() < max(steps) and time.monotonic() < deadline:
                time.sleep(POLL_S)
