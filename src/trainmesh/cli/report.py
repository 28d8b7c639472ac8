"""``trainmesh report RUN.jsonl -o report.html``: one self-contained HTML page of a run."""
from __future__ import annotations

import argparse
from typing import Any

from .paths import check_output_file


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` sub-command."""
    parser = subparsers.add_parser(
        "report", help="an HTML page of a run's metrics file (layout, ranks, every axis's charts)",
        description="Draw a --metrics-out file as one self-contained HTML page (inline SVG): the "
                    "layout in full, every rank, and the charts the run has (loss and eval, "
                    "gradient norm, tokens/s, MoE expert load, replicas and quorum events, saves, "
                    "memory and traffic per mesh axis); what the file lacks is left out with a "
                    "note (docs/METRICS.md).")
    parser.add_argument("metrics", metavar="RUN.jsonl", help="the metrics file of a run")
    parser.add_argument("-o", "--out", default="report.html", help="the HTML file (report.html)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from trainmesh.observe.report import write_report
    check_output_file("--out", args.out)
    path = write_report(args.metrics, args.out)
    print(f"trainmesh report: wrote {path}")
    return 0
