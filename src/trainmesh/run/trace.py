"""A Chrome/Perfetto trace of the last N steps of a run, every rank in one file (``--trace-out``).

Each rank keeps, for the traced steps, its compute spans (forward and backward of every
microbatch from the executor's measured timeline, then the rest of the step: gradient finish,
norm, clipping and the optimizer step) and its communication spans (every op the ledger books,
from issue to completion, with axis and bytes: :class:`trainmesh.comm.ledger.Span`). At the end
the spans are gathered through the communication layer and rank 0 writes one JSON trace:
a process per rank (``pid`` = rank), thread 0 for compute, further threads for communication
lanes (ops in flight together get separate lanes, so every track nests), so one sees where a
gradient all-reduce overlaps the backward. Times are wall-clock microseconds from the first
span of any rank (ranks line up to their hosts' clock synchronisation).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmesh.comm.ledger import Span
from trainmesh.core.layout import Group
from trainmesh.engine.engine import Engine

CATEGORY = {"F": "forward", "B": "backward", "I": "backward", "W": "backward"}


@dataclass
class Tracer:
    """Records steps ``first ..`` on this rank; :meth:`write` merges every rank's (collective)."""

    engine: Engine
    path: str
    first: int
    """The first traced step."""
    _traced: int = 0
    _ledger_bytes: int = 0
    _compute: list[tuple[str, str, float, float, dict]] = field(default_factory=list)
    _comm: list[tuple[int, Span]] = field(default_factory=list)
    """(traced step's index, span): read at the end, when every op has completed."""

    def before_step(self, step: int) -> None:
        if step >= self.first:
            self.engine.trace_comm(True)

    def after_step(self, step: int, start: float, end: float) -> None:
        """Book step ``step`` (run between ``start`` and ``end``, ``perf_counter`` seconds)."""
        if step < self.first:
            return
        self._comm += [(self._traced, s) for s in self.engine.last_step_spans()]
        self._traced += 1
        traffic = self.engine.last_step_traffic()
        self._ledger_bytes += sum(s.bytes for ops in traffic.values() for s in ops.values())
        timeline = self.engine.last_timeline
        row = timeline.ranks[min(self.engine.mesh.index(Group.pp), timeline.pp - 1)] if timeline else []
        for t in row:
            a = t.action
            name = timeline.label(a) if timeline else str(a)
            self._compute.append((name, CATEGORY[a.kind], t.start, t.end,
                                  {"step": step, "stage": a.stage, "microbatch": a.microbatch}))
        rest = max((t.end for t in row), default=start)
        self._compute.append(("optimizer step", "optimizer", rest, end,
                              {"step": step, "what": "gradient finish, norm, clip, step"}))

    def write(self) -> Path | None:
        """Collective: gather every rank's spans; rank 0 writes the trace. Its path on rank 0."""
        mesh = self.engine.mesh
        offset = time.time() - time.perf_counter()
        mine = {"rank": mesh.rank, "coords": mesh.coords,
                "compute": [(n, c, a + offset, b + offset, args) for n, c, a, b, args in self._compute],
                "comm": [(s.axis, s.op, s.nbytes, s.start + offset,
                          (s.end if s.end is not None else s.start) + offset, k)
                         for k, s in self._comm],
                "ledger_bytes": self._ledger_bytes}
        self.engine.trace_comm(False)
        gathered = self.engine.gather_object(mine)
        if mesh.rank != 0:
            return None
        trace = chrome_trace(gathered, first_step=self.first)
        path = Path(self.path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(trace))
        os.replace(tmp, path)
        return path


def chrome_trace(ranks: list[dict[str, Any]], *, first_step: int) -> dict[str, Any]:
    """Every rank's spans -> a Chrome trace object (``traceEvents`` of ``X`` spans and ``M``
    names; ``otherData`` keeps each rank's ledger bytes of the traced steps)."""
    t0 = min([c[2] for r in ranks for c in r["compute"]] + [c[3] for r in ranks for c in r["comm"]],
             default=0.0)
    us = lambda t: round((t - t0) * 1e6, 3)            # noqa: E731
    events: list[dict[str, Any]] = []
    for r in ranks:
        pid, coords = r["rank"], r["coords"]
        where = " ".join(f"{k}{v}" for k, v in coords.items())
        events += [_meta("process_name", pid, 0, f"rank {pid} ({where})"),
                   _meta("process_sort_index", pid, 0, pid), _meta("thread_name", pid, 0, "compute")]
        for name, cat, a, b, args in r["compute"]:
            events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0,
                           "ts": us(a), "dur": us(b) - us(a), "args": args})
        events += _comm_events(r["comm"], pid, us, first_step)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"ledger_bytes": {str(r["rank"]): r["ledger_bytes"] for r in ranks},
                          "first_step": first_step}}


def _comm_events(spans: list[tuple], pid: int, us, first_step: int) -> list[dict[str, Any]]:
    """Communication spans on lanes: per axis, the first lane free when the op is issued."""
    lanes: dict[str, list[float]] = {}               # axis -> end of each lane's last span
    tids: dict[tuple[str, int], int] = {}
    events: list[dict[str, Any]] = []
    for axis, op, nbytes, a, b, k in sorted(spans, key=lambda s: s[3]):
        ends = lanes.setdefault(axis, [])
        lane = next((i for i, e in enumerate(ends) if e <= a), None)
        if lane is None:
            lane = len(ends)
            ends.append(b)
        else:
            ends[lane] = b
        if (axis, lane) not in tids:
            tids[(axis, lane)] = tid = len(tids) + 1
            name = f"comm {axis}" + (f" #{lane + 1}" if lane else "")
            events.append(_meta("thread_name", pid, tid, name))
        events.append({"name": op, "cat": "comm", "ph": "X", "pid": pid, "tid": tids[(axis, lane)],
                       "ts": us(a), "dur": us(b) - us(a),
                       "args": {"axis": axis, "bytes": nbytes, "step": first_step + k,
                                "duration_us": round((b - a) * 1e6, 3)}})
    return events


def _meta(name: str, pid: int, tid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def make_tracer(engine: Engine, cfg: Any, start: int, last: int) -> Tracer | None:
    """The tracer a TrainConfig asks for (``--trace-out``): the last ``--trace-steps`` steps."""
    if cfg.trace_out is None:
        return None
    return Tracer(engine, cfg.trace_out, max(start, last - cfg.trace_steps + 1))
