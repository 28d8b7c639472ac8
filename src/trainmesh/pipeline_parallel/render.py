"""Pictures of a pipeline step: a rank-by-time text grid and an SVG/PNG timeline.

Both take a :class:`~.schedules.Timeline`, simulated (cost units) or measured by the runtime
(seconds), so ``trainmesh schedule`` and ``trainmesh train --timeline-out`` share them.

Grid: one row per rank, one column per time step of width ``tick`` (default: the shortest
action), each cell the label of the action running then (``F3``, ``B3``; ``1F3`` with virtual
stages) or ``.`` when the rank is idle. An action lasting several ticks fills several cells, so
with the default costs a backward shows as ``B3 B3``.
"""
from __future__ import annotations

from pathlib import Path

from rich.text import Text

from .analysis import bubble_fraction
from .schedules import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Timeline

__all__ = ["IDLE", "IMAGE_SUFFIXES", "draw_timeline", "format_grid", "grid_cells", "rich_grid", "row_label"]

IDLE = "."
"""Cell text of an idle time step."""
IMAGE_SUFFIXES = (".svg", ".png")
"""File types :func:`draw_timeline` writes."""

_COLOURS = {FORWARD: "#4c72b0", BACKWARD: "#55a868", BACKWARD_INPUT: "#dd8452",
            BACKWARD_WEIGHT: "#8172b3"}
_NAMES = {FORWARD: "forward", BACKWARD: "backward", BACKWARD_INPUT: "backward (input grad)",
          BACKWARD_WEIGHT: "backward (weight grad)"}
_RICH_STYLES = {FORWARD: "bold blue", BACKWARD: "bold green", BACKWARD_INPUT: "bold yellow",
                BACKWARD_WEIGHT: "bold magenta"}


def _default_tick(timeline: Timeline) -> float:
    """The mean forward duration (one chunk's forward): every schedule's grid and picture of the
    same work then share one time scale, however short its other actions (zb1p's W)."""
    forwards = [t.end - t.start for row in timeline.ranks for t in row
                if t.end > t.start and t.action.kind == FORWARD]
    if forwards:
        return sum(forwards) / len(forwards)
    durations = [t.end - t.start for row in timeline.ranks for t in row if t.end > t.start]
    return min(durations) if durations else 1.0


def row_label(timeline: Timeline, row: int) -> str:
    """What a row is: ``stage r`` when each pipeline rank holds one stage, else ``rank r`` (its
    stages r, r+pp, ...)."""
    return f"stage {row}" if timeline.virtual_stages <= 1 else f"rank {row}"


def grid_cells(timeline: Timeline, *, tick: float | None = None,
               max_columns: int = 2000) -> list[list[tuple[str, str] | None]]:
    """Per rank, per time step: ``(label, kind)`` of the running action, or ``None`` when idle.

    ``tick`` defaults to the mean forward (:func:`_default_tick`); it is widened if the grid would exceed
    ``max_columns`` (long measured timelines).
    """
    span, t0 = timeline.makespan, timeline.start
    tick = tick or _default_tick(timeline)
    if span / tick > max_columns:
        tick = span / max_columns
    ncols = round(span / tick)
    cells: list[list[tuple[str, str] | None]] = [[None] * ncols for _ in timeline.ranks]
    for rank, row in enumerate(timeline.ranks):
        for t in row:
            first = round((t.start - t0) / tick)
            last = max(round((t.end - t0) / tick), first + 1)
            for col in range(first, min(last, ncols)):
                cells[rank][col] = (timeline.label(t.action), t.action.kind)
    return cells


def format_grid(timeline: Timeline, *, tick: float | None = None) -> str:
    """The grid as plain text, one line per row: ``stage 0 | F0 F1 .  B0 B0 ...``."""
    return "\n".join(line.plain.rstrip() for line in rich_grid(timeline, tick=tick))


def rich_grid(timeline: Timeline, *, tick: float | None = None) -> list[Text]:
    """The grid as one :class:`rich.text.Text` per rank, forwards and backwards coloured."""
    cells = grid_cells(timeline, tick=tick)
    width = max((len(c[0]) for row in cells for c in row if c), default=1)
    prefix = len(row_label(timeline, timeline.pp - 1))
    lines = []
    for rank, row in enumerate(cells):
        line = Text(row_label(timeline, rank).ljust(prefix) + " |")
        for cell in row:
            line.append(" ")
            if cell is None:
                line.append(IDLE.ljust(width), style="dim")
            else:
                line.append(cell[0].ljust(width), style=_RICH_STYLES[cell[1]])
        lines.append(line)
    return lines


def draw_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """Draw one row per pipeline rank (stage), a box per action (microbatch number inside), to SVG or PNG.

    The title carries the bubble fraction. With virtual stages, later chunks are drawn lighter.
    Uses matplotlib's Agg canvas without pyplot, so no global figure state is touched.
    """
    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise ValueError(f"timeline picture must end in {' or '.join(IMAGE_SUFFIXES)}; got {path}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    t0, span = timeline.start, max(timeline.makespan, 1e-12)
    stage_forward = _default_tick(timeline) * max(timeline.virtual_stages, 1)
    width_in = min(max(8.0, 0.3 * span / stage_forward + 1.5), 40.0)   # one scale for all
    fig = Figure(figsize=(width_in, 1.0 + 0.55 * max(timeline.pp, 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    points_per_unit = (width_in - 1.5) * 72 / span
    kinds_seen: set[str] = set()
    for rank, row in enumerate(timeline.ranks):
        for t in row:
            kinds_seen.add(t.action.kind)
            face = _shade(_COLOURS[t.action.kind], t.action.stage // max(timeline.pp, 1),
                          timeline.virtual_stages)
            ax.broken_barh([(t.start - t0, t.end - t.start)], (rank - 0.4, 0.8),
                           facecolors=face, edgecolors="white", linewidth=0.8)
            box_pt = (t.end - t.start) * points_per_unit
            text = str(t.action.microbatch)
            if box_pt >= 4.5 * len(text):
                ax.text((t.start + t.end) / 2 - t0, rank, text, ha="center", va="center",
                        fontsize=min(9.0, box_pt / (0.75 * len(text) + 0.5)),
                        color="white" if sum(face) < 2.0 else "#222222")
    ax.set_ylim(timeline.pp - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_yticks(range(timeline.pp), [row_label(timeline, r) for r in range(timeline.pp)])
    ax.set_xlabel(f"time ({timeline.time_unit})")
    heading = title if title is not None else (timeline.name or "pipeline timeline")
    ax.set_title(f"{heading} — bubble {bubble_fraction(timeline):.1%}", loc="left", fontsize=10)
    handles = [Patch(color=_COLOURS[k], label=_NAMES[k]) for k in _COLOURS if k in kinds_seen]
    if timeline.virtual_stages > 1:
        handles.append(Patch(color=_shade("#808080", 1, 2), label="lighter: later chunk"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=5,
              frameon=False, fontsize=8, borderaxespad=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"Date": None} if path.suffix.lower() == ".svg" else None
    fig.savefig(path, dpi=150, metadata=metadata)
    return path


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``colour`` mixed with white: chunk 0 as is, the last chunk about half-way to white."""
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.5 * chunk / max(chunks - 1, 1) if chunks > 1 else 0.0
    return tuple(c + (1 - c) * mix for c in rgb)  # type: ignore[return-value]
