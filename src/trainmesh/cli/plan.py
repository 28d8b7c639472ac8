"""``trainmesh plan``: which layout to use, or what one layout of the built-in GPT will measure.

Advisor (any model, any cluster)::

    trainmesh plan --params 7.5e9 --gpus 64 [--gpus-per-node 8] [--gpu-mem 80GB]
                   [--precision bf16] [--layers L --hidden H --heads A --seq-len S --micro-batch B]
                   [--intra-node-bw 300GB/s --inter-node-bw 25GB/s] [--json]

Prediction (the built-in GPT, every flag of ``trainmesh train``: the same table)::

    trainmesh plan --model tiny [--dp 2 --zero 1 --microbatches 2 ...] [--json]

``--json`` prints only one JSON object on stdout; notes go to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from ..config import PRECISIONS
from ..errors import ConfigError
from ..planner.units import fmt_bytes, fmt_seconds, parse_bandwidth, parse_count, parse_size
from ..train_config import FLAGS
from .train import add_train_flags, given_flags

# The prediction mode takes every `trainmesh train` flag (one table: train_config.FLAGS); the
# advisor shares these of them and adds its own.
SHARED = ("--layers", "--heads", "--seq-len", "--vocab-size", "--global-batch", "--precision")
ADVISOR: dict[str, tuple[Any, str]] = {
    "--params": (str, "parameter count, e.g. 7.5e9 or 7.5B (advisor mode)"),
    "--gpus": (int, "total GPUs"),
    "--gpus-per-node": (int, "GPUs per node (default 8)"),
    "--gpu-mem": (str, "memory per GPU, e.g. 80GB or 80GiB (default 80GB)"),
    "--hidden": (int, "hidden size"),
    "--micro-batch": (int, "sequences per microbatch per DP rank (default 1)"),
    "--intra-node-bw": (str, "per-GPU bandwidth inside a node (default 300GB/s)"),
    "--inter-node-bw": (str, "per-GPU bandwidth between nodes (default 25GB/s)"),
}
TABLE_ROWS = 15


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command."""
    parser = subparsers.add_parser(
        "plan", help="which parallel layout to use: memory, traffic and time per layout",
        description="With --params: rank every dp x pp x tp x ZeRO layout of a model on a cluster "
                    "and recommend one. With --model: predict what `trainmesh train` measures for "
                    "one layout of the built-in GPT.")
    add_train_flags(parser)
    for flag, (typ, text) in ADVISOR.items():
        parser.add_argument(flag, type=typ, default=None, help=text)
    parser.add_argument("--json", action="store_true", help="print only one JSON object on stdout")
    parser.set_defaults(run=run)
    return parser


def _given(args: argparse.Namespace, flags: Any) -> list[str]:
    return [f for f in flags if getattr(args, f[2:].replace("-", "_")) is not None]


def run(args: argparse.Namespace) -> int:
    """Advisor or prediction by which of --params / --model is given; 0 on success."""
    if args.params is not None and args.model is not None:
        raise ConfigError("--model", "give --params (advisor) or --model (prediction), not both")
    if args.model is not None:
        wrong = _given(args, ADVISOR)
        if wrong:
            raise ConfigError(wrong[0], "is an advisor flag (with --params); with --model use "
                                        "the train flags (--dp, --d-model, ...)")
        return _predict(args)
    if args.params is None:
        raise ConfigError("--params", "give --params N to compare layouts, or --model NAME to "
                                      "predict one layout of the built-in GPT")
    wrong = [f for f in _given(args, FLAGS) if f not in SHARED]
    if wrong:
        raise ConfigError(wrong[0], "is a prediction flag (with --model); the advisor tries every "
                                    "layout itself")
    return _advise(args)


# ---------------------------------------------------------------- advisor
def _advise(args: argparse.Namespace) -> int:
    from ..planner.advisor import plan
    from ..planner.cluster import Cluster
    from ..planner.shapes import ModelShape

    if args.gpus is None:
        raise ConfigError("--gpus", "is required with --params (total GPUs, e.g. --gpus 64)")
    precision = args.precision or "bf16"
    if precision not in PRECISIONS:
        raise ConfigError("--precision", f"must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    cluster = Cluster(
        gpus=args.gpus, gpus_per_node=8 if args.gpus_per_node is None else args.gpus_per_node,
        gpu_mem_bytes=parse_size("--gpu-mem", args.gpu_mem or "80GB"),
        intra_node_bw=parse_bandwidth("--intra-node-bw", args.intra_node_bw or "300GB/s"),
        inter_node_bw=parse_bandwidth("--inter-node-bw", args.inter_node_bw or "25GB/s"))
    model = ModelShape(params=parse_count("--params", args.params), layers=args.layers,
                       hidden=args.hidden, heads=args.heads,
                       seq_len=2048 if args.seq_len is None else args.seq_len,
                       micro_batch=1 if args.micro_batch is None else args.micro_batch,
                       vocab=args.vocab_size)
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError("--global-batch", f"must be a positive integer; got {args.global_batch}")
    result = plan(model, cluster, precision=precision, global_batch=args.global_batch)
    if args.json:
        for note in result.notes:
            sys.stderr.write(f"trainmesh plan: note: {note}\n")
        print(json.dumps(result.to_json()))
        return 0
    _print_plan(result, model, cluster, precision)
    return 0


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _print_plan(result: Any, model: Any, cluster: Any, precision: str) -> None:
    console = _console()
    nodes = f"{cluster.nodes} node{'s' if cluster.nodes > 1 else ''} x {cluster.node_size}"
    table = Table(title=f"trainmesh plan: {model.params / 1e9:.3g}B params, {cluster.gpus} GPUs "
                        f"({nodes}), {fmt_bytes(cluster.gpu_mem_bytes)} each, {precision}, "
                        f"global batch {result.global_batch}")
    for name in ("", "dp", "pp", "tp", "zero", "offload", "recompute", "mb", "params", "grads",
                 "optim", "activ", "total", "fits", "comm/step", "step time"):
        table.add_column(name, justify="left" if name in ("", "offload", "recompute") else "right")
    shown = result.candidates[:TABLE_ROWS]
    if result.recommended not in shown:
        shown.append(result.recommended)
    for c in shown:
        cfg, mem = c.layout, c.memory
        mark = "->" if c is result.recommended else ""
        table.add_row(mark, str(cfg.dp), str(cfg.pp), str(cfg.tp), str(cfg.zero), cfg.offload,
                      cfg.recompute, str(cfg.microbatches), fmt_bytes(mem.params),
                      fmt_bytes(mem.grads), fmt_bytes(mem.optimizer), fmt_bytes(mem.activations),
                      fmt_bytes(mem.total), "yes" if c.fits else "no",
                      fmt_bytes(c.comm_bytes_per_step), fmt_seconds(c.time.total),
                      style="bold" if mark else None)
    console.print(table)
    rec = result.recommended.layout
    console.print(f"[bold]Recommended:[/bold] dp={rec.dp} pp={rec.pp} tp={rec.tp} zero={rec.zero} "
                  f"offload={rec.offload} recompute={rec.recompute} "
                  f"sequence-parallel={'on' if rec.sequence_parallel else 'off'} "
                  f"microbatches={rec.microbatches}")
    console.print(f"[bold]Why:[/bold] {result.why}", highlight=False)
    _print_offload(result, model, cluster, console)
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]", highlight=False)
    console.print(f"[dim]{len(result.candidates)} layouts considered, best {len(shown)} shown; "
                  "memory per GPU includes framework overhead; --json lists all[/dim]")


def _print_offload(result: Any, model: Any, cluster: Any, console: Console) -> None:
    """What offloading the recommended layout's optimizer (ZeRO >= 1) to host memory or NVMe
    would free per GPU and cost per step."""
    from dataclasses import replace

    from ..planner.candidate import evaluate
    rec = result.recommended
    if rec.layout.offload != "none":
        return
    base = replace(rec.layout, zero=max(rec.layout.zero, 1))
    parts = []
    for kind in ("cpu", "nvme"):
        c = evaluate(replace(base, offload=kind, offload_params=base.zero == 3), model, cluster)
        parts.append(f"{kind} frees {fmt_bytes(rec.memory.total - c.memory.total)} per GPU for "
                     f"{fmt_seconds(c.time.total - rec.time.total)} more per step")
    console.print(f"[bold]Offload (ZeRO-{base.zero}):[/bold] {'; '.join(parts)}", highlight=False)


# ---------------------------------------------------------------- prediction
def _predict(args: argparse.Namespace) -> int:
    from ..planner.predict import predict_run
    from ..train_config import build_train_config

    prediction = predict_run(build_train_config(given_flags(args)))
    if args.json:
        print(json.dumps(prediction.to_json()))
        return 0
    _print_prediction(prediction)
    return 0


def _ops(comm: dict[str, dict[str, int]]) -> str:
    parts = [f"{axis}.{op} {fmt_bytes(b)}" for axis, ops in comm.items() for op, b in ops.items()]
    return ", ".join(parts) or "none"


def _print_prediction(prediction: Any) -> None:
    console = _console()
    lay = prediction.layout
    table = Table(title=f"trainmesh plan: predicted metrics, {prediction.params:,} params, "
                        f"dp={lay['dp']} pp={lay['pp']} tp={lay['tp']} zero={lay['zero']} "
                        f"{lay['precision']}")
    for name in ("ranks", "pp", "params B", "grads B", "optim B", "comm bytes / step",
                 "activ MiB", "peak MiB"):
        table.add_column(name, justify="left" if name == "comm bytes / step" else "right")
    per_stage: dict[int, list[Any]] = {}
    for r in prediction.ranks:
        per_stage.setdefault(r.coords["pp"], []).append(r)
    for stage, ranks in per_stage.items():
        r = ranks[0]
        names = f"{ranks[0].rank}-{ranks[-1].rank}" if len(ranks) > 1 else str(r.rank)
        st = r.model_state_bytes
        table.add_row(names, str(stage), f"{st['params']:,}", f"{st['grads']:,}",
                      f"{st['optimizer']:,}", _ops(r.comm_bytes_per_step),
                      f"{r.activation_bytes / 2**20:.1f}", f"{r.peak_mem_bytes / 2**20:.0f}")
    console.print(table)
    tol = prediction.tolerance
    console.print(f"[dim]tolerances: model states and traffic {tol['model_state_bytes']:.0%}, "
                  f"peak memory {tol['peak_mem_bytes']:.0%} (CPU: process RSS on this "
                  "machine's measured base)[/dim]", highlight=False)
