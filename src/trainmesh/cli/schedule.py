"""``trainmesh schedule``: draw and analyse a pipeline schedule without running a model.

    trainmesh schedule --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2
                       [--out FILE.svg|FILE.png] [--json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from trainmesh.core.errors import ConfigError

from ..pipeline_parallel.analysis import (
    ScheduleSummary,
    ideal_bubble_fraction,
    summarize,
)
from ..pipeline_parallel.render import IMAGE_SUFFIXES, draw_timeline, rich_grid
from ..pipeline_parallel.schedules import SCHEDULES, build_schedule
from .paths import check_output_file


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``schedule`` sub-command."""
    parser = subparsers.add_parser(
        "schedule", help="draw and analyse a pipeline schedule (no model, no processes)",
        description="Print a rank-by-time grid of a pipeline schedule, its bubble fraction and "
                    "peak in-flight microbatches. Costs: forward of a stage 1 unit, backward 2.")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="microbatches per step (default 8)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="schedule (default 1f1b)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="model chunks per rank, interleaved only (default 1)")
    parser.add_argument("--out", metavar="FILE.svg|FILE.png", default=None,
                        help="also draw the timeline to this SVG or PNG file")
    parser.add_argument("--json", action="store_true",
                        help="print only one JSON object on stdout")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build, simulate, report; 0 on success (bad input raises ConfigError -> exit 2)."""
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix.lower() not in IMAGE_SUFFIXES:
        raise ConfigError("out", f"--out must end in {' or '.join(IMAGE_SUFFIXES)}; got {args.out!r}")
    if out is not None:
        check_output_file("--out", args.out)
    schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    summary = summarize(schedule)
    if out is not None:
        title = (f"{schedule.name}: pp={schedule.pp}, microbatches={schedule.microbatches}"
                 + (f", v={schedule.virtual_stages}" if schedule.virtual_stages > 1 else ""))
        draw_timeline(summary.timeline, out, title=title)
    if args.json:
        print(json.dumps(to_json(summary)))
    else:
        _print_report(summary, out)
    return 0


def to_json(summary: ScheduleSummary) -> dict[str, Any]:
    """The ``--json`` object (docs/PIPELINE.md) (rank keys as strings)."""
    s = summary.schedule
    return {
        "schedule": s.name,
        "pp": s.pp,
        "microbatches": s.microbatches,
        "virtual_stages": s.virtual_stages,
        "actions": {str(r): labels for r, labels in enumerate(s.labels())},
        "bubble_fraction": summary.bubble_fraction,
        "bubble_fraction_per_rank": {str(r): x for r, x in
                                     enumerate(summary.bubble_fraction_per_rank)},
        "peak_inflight_microbatches": {str(r): n for r, n in
                                       enumerate(summary.peak_inflight_microbatches)},
    }


def _print_report(summary: ScheduleSummary, out: Path | None) -> None:
    s = summary.schedule
    console = Console(soft_wrap=True, highlight=False)
    v = s.virtual_stages
    unit = "1 unit" if v == 1 else f"1/{v} unit"
    console.print(f"[bold]{s.name}[/]  pp={s.pp}  microbatches={s.microbatches}  "
                  f"virtual_stages={v}   (one column = {unit}; forward 1, backward 2 per stage)")
    for line in rich_grid(summary.timeline):
        console.print(line)
    table = Table(title=None, show_edge=False)
    for col in ("rank", "bubble", "peak in-flight", "actions"):
        table.add_column(col, justify="right")
    for r in range(s.pp):
        table.add_row(str(r), f"{summary.bubble_fraction_per_rank[r]:.1%}",
                      str(summary.peak_inflight_microbatches[r]), str(len(s.actions[r])))
    console.print(table)
    line = f"bubble fraction {summary.bubble_fraction:.4f} ({summary.bubble_fraction:.1%})"
    if s.name in ("gpipe", "1f1b"):
        ideal = ideal_bubble_fraction(s.name, microbatches=s.microbatches, pp=s.pp)
        line += f"; (p-1)/(m+p-1) = {ideal:.4f}"
    console.print(line + f"; makespan {summary.makespan:g} units")
    if out is not None:
        console.print(f"timeline written to {out}")
