"""Checking and simulating pipeline schedules: completeness, deadlock, bubble, in-flight memory.

One generic simulator runs any :class:`~.schedules.Schedule` under the cost model of
``trainmesh schedule``: a forward of a whole stage takes ``fwd_cost`` (1 unit), its backward
``bwd_cost`` (2 units); a virtual chunk takes ``1/v`` of that, and a split backward's ``I`` and
``W`` half of the chunk's backward each. Communication takes no time. Each rank runs its list in
order, one action at a time, starting an action as soon as the rank is free and its inputs exist:

* ``F(s, i)`` needs ``F(s-1, i)``;
* ``B(s, i)`` and ``I(s, i)`` need ``F(s, i)`` and the input gradient of ``s+1`` (from
  ``B(s+1, i)`` or ``I(s+1, i)``), except on the last stage;
* ``W(s, i)`` needs ``I(s, i)``.

The bubble and in-flight measures take a :class:`~.schedules.Timeline`, so they apply equally to
a simulated step and to one measured by the runtime.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from .schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    Schedule,
    ScheduleError,
    TimedAction,
    Timeline,
)

__all__ = ["ScheduleSummary", "bubble_fraction", "bubble_fraction_per_rank", "check_complete",
           "completeness_problems", "ideal_bubble_fraction", "ideal_slots",
           "peak_inflight_microbatches", "simulate", "summarize"]

# Events an action produces, keyed (event, stage, microbatch):
# "F" activation ready, "G" input gradient ready, "W" weight gradient done.
_Event = tuple[str, int, int]


def completeness_problems(schedule: Schedule) -> list[str]:
    """Every way the action lists fail to hold each rank's work exactly once (empty when fine).

    Each rank must run, for every stage it holds and every microbatch, one ``F`` and either one
    ``B`` or one ``I`` and one ``W``, and nothing for stages it does not hold.
    """
    problems: list[str] = []
    for rank, acts in enumerate(schedule.actions):
        owned = set(schedule.stages_of_rank(rank))
        counts = Counter(acts)
        for a in acts:
            if a.stage not in owned or a.microbatch >= schedule.microbatches:
                problems.append(f"rank {rank}: {a} is not this rank's work "
                                f"(stages {sorted(owned)}, microbatches < {schedule.microbatches})")
        for stage in sorted(owned):
            for mb in range(schedule.microbatches):
                problems += _pair_problems(rank, stage, mb, counts)
    return problems


def _pair_problems(rank: int, stage: int, mb: int, counts: Counter) -> list[str]:
    n = {kind: counts[Action(kind, stage, mb)] for kind in (FORWARD, BACKWARD,
                                                            BACKWARD_INPUT, BACKWARD_WEIGHT)}
    where = f"rank {rank}, stage {stage}, microbatch {mb}"
    out = []
    if n[FORWARD] != 1:
        out.append(f"{where}: {n[FORWARD]} forwards (need 1)")
    full, split = n[BACKWARD], (n[BACKWARD_INPUT], n[BACKWARD_WEIGHT])
    if not ((full == 1 and split == (0, 0)) or (full == 0 and split == (1, 1))):
        out.append(f"{where}: {full} B, {split[0]} I, {split[1]} W (need one B, or one I and one W)")
    return out


def check_complete(schedule: Schedule) -> None:
    """Raise :class:`~.schedules.ScheduleError` listing problems if the lists are incomplete."""
    problems = completeness_problems(schedule)
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ScheduleError(f"{schedule.name}: incomplete schedule: "
                            + "; ".join(problems[:5]) + more)


def _needs(a: Action, num_stages: int) -> list[_Event]:
    if a.kind == FORWARD:
        return [("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
    if a.kind == BACKWARD_WEIGHT:
        return [("G", a.stage, a.microbatch)]
    needs = [("F", a.stage, a.microbatch)]
    if a.stage < num_stages - 1:
        needs.append(("G", a.stage + 1, a.microbatch))
    return needs


def _produces(a: Action) -> list[_Event]:
    return {FORWARD: [("F", a.stage, a.microbatch)],
            BACKWARD: [("G", a.stage, a.microbatch), ("W", a.stage, a.microbatch)],
            BACKWARD_INPUT: [("G", a.stage, a.microbatch)],
            BACKWARD_WEIGHT: [("W", a.stage, a.microbatch)]}[a.kind]


def _costs(schedule: Schedule, fwd_cost: float, bwd_cost: float) -> dict[str, Fraction]:
    if fwd_cost <= 0 or bwd_cost <= 0:
        raise ValueError(f"costs must be > 0; got fwd_cost={fwd_cost}, bwd_cost={bwd_cost}")
    v = schedule.virtual_stages
    f, b = Fraction(fwd_cost) / v, Fraction(bwd_cost) / v
    return {FORWARD: f, BACKWARD: b, BACKWARD_INPUT: b / 2, BACKWARD_WEIGHT: b / 2}


def simulate(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> Timeline:
    """Run ``schedule`` under the cost model; return when every action starts and ends.

    Times are computed exactly (rationals) and stored as floats. Raises
    :class:`~.schedules.ScheduleError` if the lists are incomplete or the order deadlocks.
    """
    check_complete(schedule)
    cost = _costs(schedule, fwd_cost, bwd_cost)
    done: dict[_Event, Fraction] = {}
    clock = [Fraction(0)] * schedule.pp
    pos = [0] * schedule.pp
    rows: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(schedule.actions):
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                needs = _needs(a, schedule.num_stages)
                if any(e not in done for e in needs):
                    break
                start = max([clock[rank]] + [done[e] for e in needs])
                clock[rank] = start + cost[a.kind]
                done.update((e, clock[rank]) for e in _produces(a))
                rows[rank].append(TimedAction(a, float(start), float(clock[rank])))
                pos[rank] += 1
                progressed = True
    if any(pos[r] < len(acts) for r, acts in enumerate(schedule.actions)):
        raise ScheduleError(f"{schedule.name}: deadlock: " + _stuck(schedule, pos, done))
    return Timeline(rows, virtual_stages=schedule.virtual_stages, time_unit="units",
                    name=schedule.name)


def _stuck(schedule: Schedule, pos: list[int], done: dict[_Event, Fraction]) -> str:
    parts = []
    for rank, acts in enumerate(schedule.actions):
        if pos[rank] < len(acts):
            a = acts[pos[rank]]
            missing = [f"{k}{s}:{mb}" for k, s, mb in _needs(a, schedule.num_stages)
                       if (k, s, mb) not in done]
            parts.append(f"rank {rank} waits at {a} for {', '.join(missing)}")
    return "; ".join(parts)


def bubble_fraction_per_rank(timeline: Timeline) -> list[float]:
    """Each rank's idle time over the step's makespan (0.0 for an empty timeline)."""
    span = timeline.makespan
    if span <= 0:
        return [0.0] * timeline.pp
    return [(span - timeline.busy(r)) / span for r in range(timeline.pp)]


def bubble_fraction(timeline: Timeline) -> float:
    """Mean of :func:`bubble_fraction_per_rank`: total idle over ``pp * makespan``.

    Computed as one division, so it is exactly ``(p-1)/(m+p-1)`` for simulated gpipe and 1f1b.
    """
    span = timeline.makespan
    if span <= 0 or timeline.pp == 0:
        return 0.0
    total = timeline.pp * span
    return (total - sum(timeline.busy(r) for r in range(timeline.pp))) / total


def ideal_slots(schedule: str, *, microbatches: int, pp: int, virtual_stages: int = 1) -> float:
    """Step length in microbatch-stage slots by the textbook formula (``m`` with no pipeline).

    GPipe and 1F1B take ``m + p - 1`` (bubble fraction ``(p-1)/(m+p-1)``, what
    :func:`simulate` gives them exactly with backward = 2 forwards); interleaving over ``v``
    chunks divides the bubble by ``v``; ZB-H1 is taken as a third of 1F1B's bubble; the naive
    schedule runs ``m*p`` slots. The planner's step-time model uses this formula.
    """
    m, p, v = microbatches, pp, virtual_stages
    if p == 1:
        return float(m)
    if schedule == "naive":
        return float(m * p)
    if schedule == "zb1p":
        return m + (p - 1) / 3
    return m + (p - 1) / v


def ideal_bubble_fraction(schedule: str, *, microbatches: int, pp: int,
                          virtual_stages: int = 1) -> float:
    """The idle share of a step by :func:`ideal_slots`: ``(slots - m) / slots``."""
    slots = ideal_slots(schedule, microbatches=microbatches, pp=pp, virtual_stages=virtual_stages)
    return (slots - microbatches) / slots


def peak_inflight_microbatches(source: Schedule | Timeline) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs holding activations at once.

    A pair is in flight from its forward until its backward finishes (``B``, or ``W`` when the
    backward is split), counted once; order is the rank's execution order.
    """
    if isinstance(source, Timeline):
        orders = [[t.action for t in sorted(row, key=lambda t: (t.start, t.end))]
                  for row in source.ranks]
    else:
        orders = source.actions
    peaks = []
    for acts in orders:
        live: set[tuple[int, int]] = set()
        peak = 0
        for a in acts:
            if a.is_forward:
                live.add((a.stage, a.microbatch))
                peak = max(peak, len(live))
            elif a.frees_activations:
                live.discard((a.stage, a.microbatch))
        peaks.append(peak)
    return peaks


@dataclass(frozen=True)
class ScheduleSummary:
    """The numbers ``trainmesh schedule`` reports for one schedule under the cost model."""

    schedule: Schedule
    """The analysed schedule."""
    timeline: Timeline
    """Its simulated timeline."""
    bubble_fraction: float
    """Mean idle fraction over ranks."""
    bubble_fraction_per_rank: list[float]
    """Idle fraction of each rank."""
    peak_inflight_microbatches: list[int]
    """Peak in-flight (stage, microbatch) pairs of each rank."""

    @property
    def makespan(self) -> float:
        """Simulated step time in cost units."""
        return self.timeline.makespan


def summarize(schedule: Schedule, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> ScheduleSummary:
    """Simulate ``schedule`` and gather its bubble and in-flight numbers."""
    timeline = simulate(schedule, fwd_cost, bwd_cost)
    return ScheduleSummary(schedule, timeline, bubble_fraction(timeline),
                           bubble_fraction_per_rank(timeline),
                           peak_inflight_microbatches(schedule))
