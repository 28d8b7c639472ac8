"""The communication ledger: calls, payload bytes and seconds per (mesh axis, op), per step.

Payload bytes follow the nccl-tests convention (docs/METRICS.md): all_reduce, broadcast and reduce
count the tensor; all_gather the gathered output; reduce_scatter the unreduced input;
scatter/gather the full buffer; all_to_all the input; send/recv the tensor.

Axes are the mesh's: ``dp``, ``tp``, ``pp`` and ``world`` (the whole world, e.g. the loss and
gradient-norm reductions). The metrics file names the world's axis ``other`` (docs/METRICS.md:
groups spanning several axes): :meth:`Ledger.bytes_per_step` reports it under that name.

Traffic is attributed to the open step window; traffic outside any window (set-up, e.g. an
initial broadcast) is kept apart, so per-step averages describe training only. Memory stays
bounded however long the run: the ledger keeps the tables of the last ``keep`` step windows
(``steps``) and running totals over all of them (``totals``, which the averages use).

While ``tracing`` (``--trace-out``), every op of a step window also leaves a :class:`Span`
(issue to completion, ``perf_counter`` seconds) in ``spans``; off, it costs one test per op.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

KEEP_STEPS = 64
"""Step windows a ledger keeps by default (the per-step tables; the totals cover every step)."""
METRICS_NAME = {"world": "other"}
"""Mesh axis -> its key in the metrics file's ``comm_bytes_per_step`` where the two differ."""


def canonical_axis(axis: str) -> str:
    """The mesh's name of an axis; the metrics name ``other`` means ``world``."""
    return "world" if axis == "other" else axis


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds


@dataclass
class Span:
    """One op as this rank saw it: issued at ``start``, complete at ``end`` (None: in flight)."""

    step: int
    """Index of the step window (0-based, as in ``Ledger.steps``)."""
    axis: str
    op: str
    nbytes: int
    start: float
    end: float | None = None


def _stats_table() -> defaultdict[str, defaultdict[str, OpStats]]:
    return defaultdict(lambda: defaultdict(OpStats))


@dataclass
class Ledger:
    """Per-step accounting of everything the communication layer sends."""

    keep: int = KEEP_STEPS
    """How many of the most recent step windows ``steps`` holds."""
    steps: deque[dict[str, dict[str, OpStats]]] = field(init=False)
    """The tables of the last ``keep`` step windows, oldest first."""
    closed: int = 0
    """Step windows closed so far (the next window's index)."""
    totals: defaultdict[str, defaultdict[str, OpStats]] = field(default_factory=_stats_table)
    """Every closed step window's traffic, summed."""
    setup: defaultdict[str, defaultdict[str, OpStats]] = field(default_factory=_stats_table)
    _window: defaultdict[str, defaultdict[str, OpStats]] | None = None
    tracing: bool = False
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"Ledger.keep must be >= 1; got {self.keep}")
        self.steps = deque(maxlen=self.keep)

    def open_span(self, axis: str, op: str, nbytes: int, start: float) -> Span | None:
        """A span for an op issued at ``start`` inside a step window, while tracing; else None."""
        if not self.tracing or self._window is None:
            return None
        span = Span(self.closed, canonical_axis(axis), op, nbytes, start)
        self.spans.append(span)
        return span

    def step_bytes(self, step: int) -> int:
        """Payload bytes of step window ``step`` (0-based, one of the last ``keep``) over every
        axis and op."""
        index = step - (self.closed - len(self.steps))
        if not 0 <= index < len(self.steps):
            raise IndexError(f"step window {step} is not kept: the ledger holds windows "
                             f"{self.closed - len(self.steps)}..{self.closed - 1}")
        return sum(s.bytes for ops in self.steps[index].values() for s in ops.values())

    def record(self, axis: str, op: str, nbytes: int, seconds: float = 0.0) -> None:
        table = self._window if self._window is not None else self.setup
        table[canonical_axis(axis)][op].add(nbytes, seconds)

    def add_seconds(self, axis: str, op: str, seconds: float) -> None:
        """Add waiting time to an op already recorded (async ops finish later)."""
        table = self._window if self._window is not None else self.setup
        table[canonical_axis(axis)][op].seconds += seconds

    def begin_step(self) -> None:
        self._window = _stats_table()

    def end_step(self) -> dict[str, dict[str, OpStats]]:
        """Close the step window and return its table."""
        window, self._window = self._window or _stats_table(), None
        self.steps.append(window)
        self.closed += 1
        for axis, ops in window.items():
            for op, stats in ops.items():
                total = self.totals[axis][op]
                total.calls += stats.calls
                total.bytes += stats.bytes
                total.seconds += stats.seconds
        return window

    def bytes_per_step(self, axes: tuple[str, ...] = ("dp", "tp", "pp", "other")) -> dict[str, dict[str, float]]:
        """Average payload bytes per training step, {axis: {op: bytes}} (every axis present),
        keyed as in the metrics file (the world's axis as ``other``)."""
        out: dict[str, dict[str, float]] = {axis: {} for axis in axes}
        n = max(self.closed, 1)
        for axis, ops in self.totals.items():
            for op, stats in ops.items():
                row = out.setdefault(METRICS_NAME.get(axis, axis), {})
                row[op] = row.get(op, 0.0) + stats.bytes / n
        return out

    def seconds_per_step(self) -> float:
        n = max(self.closed, 1)
        return sum(s.seconds for ops in self.totals.values() for s in ops.values()) / n
