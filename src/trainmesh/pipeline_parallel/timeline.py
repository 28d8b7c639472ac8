"""The measured timeline of a pipeline step: every rank's actions gathered on rank 0.

Each :class:`~.runtime.PipelineExecutor` keeps its own row of the last step (``perf_counter``
seconds). :func:`gather_timeline` is a collective over the world through the communication layer
(call it on every rank, outside any step window): rank 0 receives every rank's row, keeps the
pipeline of DP and TP index 0, and returns a :class:`~.schedules.Timeline` in seconds relative to
the earliest action start.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainmesh.core.layout import Group
from ..comm import Comm
from .schedules import Action, TimedAction, Timeline


def gather_timeline(executor: Any, comm: Comm) -> Timeline | None:
    """The last step's per-rank timeline on global rank 0 (``None`` on the others).

    ``executor`` is the engine's executor (one without a pipeline has no ``last_timeline`` and
    contributes nothing). Times are converted to wall-clock before the gather so ranks on
    different hosts line up (to the precision of their clock synchronisation), then made
    relative to the earliest start.
    """
    mesh = comm.mesh
    own: Timeline | None = executor.last_timeline
    row = own.ranks[mesh.index(Group.pp)] if own is not None else []
    offset = time.time() - time.perf_counter()
    mine = (mesh.coords, [(t.action.kind, t.action.stage, t.action.microbatch,
                           t.start + offset, t.end + offset) for t in row])
    gathered = comm.all_gather_object(mine, Group.world)
    if mesh.rank != 0 or own is None:
        return None
    rows: list[list[TimedAction]] = [[] for _ in range(mesh.size(Group.pp))]
    for coords, entries in gathered:
        if coords["dp"] == 0 and coords["tp"] == 0:
            rows[coords["pp"]] = [TimedAction(Action(k, s, mb), a, b) for k, s, mb, a, b in entries]
    t0 = min((t.start for r in rows for t in r), default=0.0)
    rows = [[TimedAction(t.action, t.start - t0, t.end - t0) for t in r] for r in rows]
    return Timeline(rows, virtual_stages=own.virtual_stages, time_unit="s", name=own.name)


def write_timeline(executor: Any, comm: Comm, path: str | Path, *,
                   title: str | None = None) -> Path | None:
    """Gather the last step's timeline and draw it to ``path`` (SVG/PNG) on rank 0.

    Collective: call on every rank. Returns the path on rank 0, ``None`` elsewhere.
    """
    timeline = gather_timeline(executor, comm)
    if timeline is None:
        return None
    from .render import draw_timeline
    return draw_timeline(timeline, path, title=title or f"{timeline.name} (measured step)")
