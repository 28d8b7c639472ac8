"""``trainmesh bench comm``: an nccl-tests-style table for each collective over the comm layer."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from trainmesh.core.errors import ConfigError

from ..planner.units import parse_size

DEFAULT_SIZES = "4KB,64KB,1MB,16MB"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure collectives (nccl-tests style)")
    what = p.add_subparsers(dest="what", metavar="WHAT", parser_class=type(p))
    c = what.add_parser("comm", help="time each collective over sizes; bus bandwidth per op")
    c.add_argument("--sizes", default=DEFAULT_SIZES, help=f"payload sizes (default {DEFAULT_SIZES})")
    c.add_argument("--ops", default=",".join(_ops()), help="collectives to time")
    c.add_argument("--algorithms", default="native",
                   help="all_reduce algorithms to compare: native (the backend's), ring, tree, naive")
    c.add_argument("--nproc", type=int, default=2, help="local worker processes (default 2)")
    c.add_argument("--iters", type=int, default=10, help="timed repetitions per size")
    c.add_argument("--json", action="store_true", help="print only a JSON list of rows")
    p.set_defaults(run=run)


def _ops() -> tuple[str, ...]:
    from ..comm.bench import OPS
    return OPS


def run(args: argparse.Namespace) -> int:
    if getattr(args, "what", None) != "comm":
        raise ConfigError("bench", "name what to measure: trainmesh bench comm")
    sizes = [parse_size("sizes", s) for s in args.sizes.split(",") if s]
    if not sizes:
        raise ConfigError("sizes", f"give at least one size, e.g. {DEFAULT_SIZES}; got {args.sizes!r}")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in _ops()]
    if bad:
        raise ConfigError("ops", f"unknown {', '.join(bad)}; valid: {', '.join(_ops())}")
    from ..comm.algorithms import ALGORITHMS
    algorithms = [a for a in args.algorithms.split(",") if a]
    bad = [a for a in algorithms if a not in ALGORITHMS]
    if bad or not algorithms:
        raise ConfigError("algorithms", f"unknown {', '.join(bad) or '(none)'}; valid: {', '.join(ALGORITHMS)}")
    if args.nproc < 2:
        raise ConfigError("nproc", f"must be >= 2; got {args.nproc}")
    if args.iters < 1:
        raise ConfigError("iters", f"must be >= 1; got {args.iters}")
    from ..comm.bench import measure
    from ..testing import run_distributed
    rows = run_distributed(measure, args.nproc, sizes, ops, args.iters, algorithms, timeout_s=120)[0]
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"trainmesh bench comm: {args.nproc} processes, {rows[0].backend}")
    for col in ("op", "algorithm", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)",
                "sent/rank max", "theory", "max |diff|"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.op, r.algorithm, f"{r.size_bytes:,}", f"{r.time_s * 1e6:,.1f}",
                      f"{r.algbw / 1e9:.3f}", f"{r.busbw / 1e9:.3f}", _num(r.sent_bytes_max_rank),
                      _num(r.sent_bytes_theory), "" if r.max_abs_diff_vs_native is None
                      else f"{r.max_abs_diff_vs_native:.1e}")
    Console().print(table)
    return 0


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:,.0f}"
