"""``trainmesh plan``: which layout to use, or what one layout of the built-in GPT will measure.

Advisor (any model, any cluster)::

    trainmesh plan --params 7.5e9 --gpus 64 [--gpus-per-node 8] [--gpu-mem 80GB]
                   [--precision bf16] [--layers L --hidden H --heads A --seq-len S --micro-batch B]
                   [--intra-node-bw 300GB/s --inter-node-bw 25GB/s] [--json]
    trainmesh plan --model NAME | --model-dir DIR --gpus N [--calibrate RUN.jsonl] ...

Prediction (the built-in GPT, every flag of ``trainmesh train``: the same table)::

    trainmesh plan --model tiny [--dp 2 --zero 1 --microbatches 2 ...] [--json]

``--json`` prints only one JSON object on stdout; notes go to stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

from rich.console import Console

from trainmesh.config.parallel import PRECISIONS
from trainmesh.config.train import FLAGS
from trainmesh.core.errors import ConfigError
from trainmesh.observe.progress import console, fmt_size, wide_table

from ..planner.units import (
    fmt_bytes,
    fmt_seconds,
    parse_bandwidth,
    parse_count,
    parse_size,
)
from .train import add_train_flags, given_flags

# The prediction mode takes the `trainmesh train` flags the model of a run uses (one table:
# train_config.FLAGS); the advisor shares the shape ones and adds its own.
SHARED = ("--layers", "--heads", "--seq-len", "--vocab-size", "--global-batch", "--precision",
          "--peak-tflops", "--gpu", "--experts", "--top-k", "--optimizer", "--tp-plan", "--pp-plan",
          "--ep-plan")
PLAN_FILES = ("--tp-plan", "--pp-plan", "--ep-plan")
"""A Hugging Face model's plan files: with --model-dir only (the run's flags)."""
PLAN_GROUPS = ("layout", "model", "precision & memory")
OWN = ("--model", "--model-dir", "--peak-tflops", "--gpu")   # declared here, for both modes
ADVISOR_MODEL: dict[str, tuple[Any, str]] = {
    "--params": (str, "parameter count, e.g. 7.5e9 or 7.5B (advisor; give the shape too)"),
    "--hidden": (int, "hidden size (advisor)"),
    "--micro-batch": (int, "sequences per microbatch per DP rank (advisor; default 1)"),
    "--document-len": (float, "packed documents (--documents packed): their mean length in tokens, "
                              "weighted by length (sum of L^2 / sum of L); attention FLOPs are "
                              "counted within documents, not over --seq-len (advisor)"),
    "--model-dir": (str, "a Hugging Face model directory: shape, experts and the axes it has plans "
                         "for, from its config.json (advisor)"),
    "--kernels": (str, "whose kernels the activations are counted for: trainmesh (fused attention, "
                       "selective recompute of the attention core; the default), torchtitan "
                       "(op-level selective recompute) or megatron-2021 (unfused attention with "
                       "dropout) (advisor)"),
    "--calibrate": (str, "a metrics file trainmesh train wrote for this model: its measured "
                         "step time and peak memory set the efficiency and memory model "
                         "(advisor; default: the table of published runs)"),
}
CLUSTER: dict[str, tuple[Any, str]] = {
    "--gpus": (int, "total GPUs (advisor)"),
    "--gpus-per-node": (int, "GPUs per node (default: the --gpu row's, 8)"),
    "--gpu-mem": (str, "memory per GPU, e.g. 80GB or 80GiB (default: the --gpu row's)"),
    "--intra-node-bw": (str, "per-GPU bandwidth inside a node (default: the --gpu row's)"),
    "--inter-node-bw": (str, "per-GPU bandwidth between nodes (default: the --gpu row's)"),
    "--peak-tflops": (float, "one GPU's dense 16-bit peak TFLOP/s (default: the --gpu row's)"),
}
ADVISOR = {**ADVISOR_MODEL, **{k: v for k, v in CLUSTER.items() if k != "--peak-tflops"}}
TABLE_ROWS = 15
NARROW = 130
"""Below this many columns the advisor's table keeps only the columns that decide."""
DETAIL = ("params", "grads", "optim", "activ", "comm/step")


def _plan_flags() -> list[str]:
    """The train flags the prediction uses: layout, model shape, precision and memory, the
    global batch and the optimizer (what the model of a run's bytes depends on)."""
    keep = [flag for flag, f in FLAGS.items() if f.group in PLAN_GROUPS]
    return [f for f in keep + ["--global-batch", "--optimizer"] if f not in OWN]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command."""
    from trainmesh.core.gpus import DEFAULT_GPU, GPUS

    from ..planner.published import MODELS
    parser = subparsers.add_parser(
        "plan", help="which parallel layout to use: memory, traffic and time per layout",
        usage="trainmesh plan (--model NAME | --model-dir DIR | --params N --layers L --hidden H "
              "--heads A) --gpus N [--gpu NAME] ... | trainmesh plan --model tiny [train layout flags]",
        description="Advisor: with --model NAME (a published shape), --model-dir DIR or --params "
                    "and the shape, rank every layout (dp, pp, tp, cp, ep, ZeRO, HSDP, schedule, "
                    "recompute, offload) on a cluster and recommend one. Prediction: with --model "
                    "tiny|small, predict what `trainmesh train` measures for one layout of the "
                    "built-in GPT.")
    groups = add_train_flags(parser, keep=_plan_flags(), titles={
        "layout": "layout (prediction: --model tiny|small)",
        "precision & memory": "precision & memory (--precision: both modes; the rest prediction)"})
    model = groups.get("model") or parser.add_argument_group("model")
    from ..models.gpt import PRESETS
    model.add_argument("--model", default=None, metavar="NAME",
                       help=f"a published shape for the advisor ({', '.join(MODELS)}) or a "
                            f"built-in GPT preset to predict ({', '.join(PRESETS)})")
    for flag, (typ, text) in ADVISOR_MODEL.items():
        model.add_argument(flag, type=typ, default=None, help=text)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpu", default=None, metavar="NAME",
                         help=f"the accelerator: {', '.join(GPUS)} (default {DEFAULT_GPU}; "
                              "--list-gpus shows the table)")
    cluster.add_argument("--list-gpus", action="store_true",
                         help="print the table of known accelerators and exit")
    for flag, (typ, text) in CLUSTER.items():
        cluster.add_argument(flag, type=typ, default=None, help=text)
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print only one JSON object on stdout")
    parser.set_defaults(run=run)
    return parser


def _given(args: argparse.Namespace, flags: Any) -> list[str]:
    return [f for f in flags if getattr(args, f[2:].replace("-", "_"), None) is not None]


def run(args: argparse.Namespace) -> int:
    """Advisor or prediction by which of --params / --model is given; 0 on success."""
    from ..models.gpt import PRESETS
    if args.list_gpus:
        _print_gpus()
        return 0
    given_models = [f for f, v in (("--model", args.model), ("--params", args.params),
                                   ("--model-dir", args.model_dir)) if v is not None]
    if len(given_models) > 1:
        raise ConfigError(given_models[1], f"give one of --model NAME, --params N (with the shape) "
                                           f"or --model-dir DIR; got {' and '.join(given_models)}")
    if args.model is not None and args.model in PRESETS:
        wrong = _given(args, ADVISOR)   # --gpu and --peak-tflops: accepted (no time predicted)
        if wrong:
            raise ConfigError(wrong[0], "is an advisor flag; with --model tiny|small use "
                                        "the train flags (--dp, --d-model, ...)")
        return _predict(args)
    if not given_models:
        raise ConfigError("--params", "give --model NAME (a published shape, or tiny|small to "
                                      "predict one layout of the built-in GPT), --model-dir DIR, "
                                      "or --params N with --layers, --hidden and --heads")
    wrong = [f for f in _given(args, FLAGS) if f not in SHARED and f not in ("--model", "--model-dir")]
    if wrong:
        raise ConfigError(wrong[0], "is a prediction flag (with --model tiny|small); the advisor "
                                    "tries every layout itself")
    return _advise(args)


# ---------------------------------------------------------------- advisor
def _advise(args: argparse.Namespace) -> int:
    from trainmesh.core.gpus import DEFAULT_GPU, gpu

    from ..planner.advisor import plan

    if args.gpus is None:
        raise ConfigError("--gpus", "is required by the advisor (total GPUs, e.g. --gpus 64)")
    precision = args.precision or "bf16"
    if precision not in PRECISIONS:
        raise ConfigError("--precision", f"must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    row = gpu(args.gpu or DEFAULT_GPU)
    model, batch, axes, plan_notes = _shape(args)
    cluster = _cluster(args, row)
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError("--global-batch", f"must be a positive integer; got {args.global_batch}")
    kernels = _kernels(args.kernels)
    if args.model_dir is not None and args.kernels is None:   # trainmesh runs transformers' modules
        kernels = replace(kernels, rmsnorm="eager")
    source = None
    optimizer = args.optimizer or "adamw"
    if args.calibrate is not None:   # a run of --optimizer: its step time holds Muon's step
        from ..planner.calibrate import calibrate
        cal = calibrate(args.calibrate, model, cluster, kernels, optimizer)
        cluster = replace(cluster, efficiency=cal.efficiency, memory_scale=cal.memory_scale)
        source = cal.source
    result = plan(model, cluster, precision=precision, global_batch=batch, axes_allowed=axes,
                  kernels=kernels, efficiency_source=source, optimizer=optimizer)
    notes = [*result.notes, *plan_notes]
    if args.gpu is None:
        notes.insert(0, f"no --gpu: assuming {row.name} ({fmt_bytes(cluster.gpu_mem_bytes)}, "
                        f"{cluster.peak_flops / 1e12:g} TFLOP/s 16-bit peak); --list-gpus shows others")
    if args.json:
        for note in notes:
            sys.stderr.write(f"trainmesh plan: note: {note}\n")
        print(json.dumps(result.to_json()))
        return 0
    _print_plan(result, model, result.cluster, precision, gpu_name=row.name, notes=notes,
                optimizer=optimizer)
    return 0


def _shape(args: argparse.Namespace) -> tuple[Any, int | None, frozenset[str], list[str]]:
    """(the model's shape, the global batch: --global-batch, the published run's, or None, the
    model-parallel axes it has plans for, notes on them). Without layers, hidden and heads
    activations cannot be estimated: exit 2 naming them."""
    from dataclasses import asdict

    from ..planner import model_dir
    from ..planner.published import published
    from ..planner.shapes import ModelShape
    base: dict[str, Any] = {}
    batch = args.global_batch
    axes = frozenset({"tp", "pp", "cp", "ep"})
    notes: list[str] = []
    files = _given(args, PLAN_FILES)
    if files and args.model_dir is None:
        raise ConfigError(files[0], "is a plan for a Hugging Face model; needs --model-dir")
    if args.model is not None:
        pub = published(args.model)
        base = asdict(pub.shape)
        batch = batch if batch is not None else pub.global_batch
    if args.model_dir is not None:
        from ..models.hf_plans import PlanFiles
        plans = PlanFiles(tp=args.tp_plan, pp=args.pp_plan, ep=args.ep_plan)
        shape, axes, _, notes = model_dir.read(args.model_dir, plans)
        base = asdict(shape)
    given = dict(params=parse_count("--params", args.params) if args.params is not None else None,
                 layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab_size,
                 seq_len=args.seq_len, experts=args.experts, top_k=args.top_k,
                 document_len=args.document_len)
    base.update({k: v for k, v in given.items() if v is not None})
    if base.get("experts") and not base.get("top_k"):
        base["top_k"] = 2
    base["micro_batch"] = 1 if args.micro_batch is None else args.micro_batch
    model = ModelShape(**{"seq_len": 2048, **base})
    missing = model.missing_shape_flags()
    if missing:
        raise ConfigError(missing[0], f"the advisor needs the model's shape to count activations: "
                                      f"give {', '.join(missing)} (or --model NAME for a published "
                                      "shape, `trainmesh plan --help` lists them)")
    return model, batch, axes, notes


def _kernels(name: str | None) -> Any:
    from ..planner.references import KERNELS
    if name is None:
        return KERNELS["trainmesh"]
    if name not in KERNELS:
        raise ConfigError("--kernels", f"must be one of {', '.join(KERNELS)}; got {name!r}")
    return KERNELS[name]


def _cluster(args: argparse.Namespace, row: Any) -> Any:
    from ..planner.cluster import Cluster
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"must be a positive integer; got {args.gpus_per_node}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise ConfigError("--peak-tflops", f"must be a finite number > 0; got {args.peak_tflops}")
    return Cluster(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node or row.gpus_per_node, gpu=row.name,
        gpu_mem_bytes=parse_size("--gpu-mem", args.gpu_mem) if args.gpu_mem else row.mem_bytes,
        intra_node_bw=(parse_bandwidth("--intra-node-bw", args.intra_node_bw)
                       if args.intra_node_bw else row.intra_node_bw),
        inter_node_bw=(parse_bandwidth("--inter-node-bw", args.inter_node_bw)
                       if args.inter_node_bw else row.inter_node_bw),
        peak_flops=(args.peak_tflops if args.peak_tflops is not None
                    else row.peak("bf16") or row.peak("fp16")) * 1e12)


def _print_gpus() -> None:
    from trainmesh.core.gpus import TABLE_HEADER, table_rows
    table = wide_table("trainmesh plan: known accelerators (dense peaks; bandwidth per GPU and "
                       "direction)", TABLE_HEADER)
    for row in table_rows():
        table.add_row(*row)
    console().print(table)


def _layout_text(cfg: Any) -> str:
    """The recommended layout as flags would say it."""
    parts = [cfg.layout.describe("flags")]
    if cfg.pp > 1:
        parts.append(f"schedule={cfg.schedule}" + (f"x{cfg.virtual_stages}" if cfg.virtual_stages > 1 else ""))
    if cfg.cp > 1:
        parts.append(f"cp-comm={cfg.cp_comm}")
    parts += [f"zero={cfg.zero}", f"offload={cfg.offload}", f"recompute={cfg.recompute}",
              f"sequence-parallel={'on' if cfg.sequence_parallel else 'off'}",
              f"microbatches={cfg.microbatches}"]
    return " ".join(parts)


def _print_plan(result: Any, model: Any, cluster: Any, precision: str, *, gpu_name: str,
                notes: list[str], optimizer: str = "adamw") -> None:
    out = console()
    rec = result.recommended
    cfg = rec.layout
    nodes = f"{cluster.nodes} node{'s' if cluster.nodes > 1 else ''} x {cluster.node_size}"
    experts = (f", {model.experts} experts of {model.expert_width} in {model.moe_layer_count} layers, "
               f"top {model.top_k}, {model.active_params / 1e9:.3g}B active") if model.is_moe else ""
    out.print(f"[bold]trainmesh plan:[/bold] {model.params / 1e9:.4g}B params ({model.layers} "
              f"layers, hidden {model.hidden}, {model.heads} heads, seq {model.seq_len}{experts}"
              f"{_documents(model)}), "
              f"{cluster.gpus} x {gpu_name} ({nodes}, {fmt_bytes(cluster.gpu_mem_bytes)} each), "
              f"{precision}{'' if optimizer == 'adamw' else ', ' + optimizer}, "
              f"global batch {result.global_batch}", highlight=False)
    out.print(f"[bold]Recommended:[/bold] {_layout_text(cfg)}: {fmt_bytes(rec.memory.total)} per GPU, "
              f"est. {fmt_seconds(rec.time.total)} per step, {_mfu(rec, model, cluster, result)}",
              highlight=False)
    out.print(f"[bold]Why:[/bold] {result.why}", highlight=False)
    if model.is_moe:
        edp = max(1, cfg.dp * cfg.cp // cfg.ep)
        a2a = rec.traffic.get("ep", {}).get("all_to_all", 0.0)
        out.print(f"[bold]Experts:[/bold] {model.experts // cfg.ep} of {model.experts} per MoE layer on "
                  f"each GPU (ep={cfg.ep}): {fmt_bytes(rec.expert_state_bytes)} of expert states "
                  f"(ZeRO-{cfg.zero} over edp={edp}); all-to-all {fmt_bytes(a2a)} per step per GPU "
                  "(routing taken as balanced)", highlight=False)
    columns = ["", "dp", "pp", "tp", "cp", *(["ep"] if model.is_moe else []), "zero", "offload",
               "recompute", "mb", "params", "grads", "optim", "activ", "total", "fits", "comm/step",
               "step time"]
    narrow = out.width < NARROW   # an 80-column terminal: the columns that decide
    keep = [c for c in columns if not narrow or c not in DETAIL]
    table = wide_table(None, keep, compact=narrow)
    shown = [rec] + [c for c in result.candidates if c is not rec][:TABLE_ROWS - 1]
    for c in shown:
        lay, mem = c.layout, c.memory
        mark = "->" if c is rec else ""
        dp = f"{lay.dp}/{lay.shard_size}" if lay.shard_size < lay.dp else str(lay.dp)
        dp += " DiLoCo" if lay.strategy == "diloco" else ""
        pp = f"{lay.pp}x{lay.virtual_stages}" if lay.virtual_stages > 1 else str(lay.pp)
        cp = f"{lay.cp} ag" if lay.cp_comm == "allgather" else str(lay.cp)
        cells = {"": mark, "dp": dp, "pp": pp, "tp": str(lay.tp), "cp": cp, "ep": str(lay.ep),
                 "zero": str(lay.zero), "offload": lay.offload, "recompute": lay.recompute,
                 "mb": str(lay.microbatches), "params": fmt_bytes(mem.params),
                 "grads": fmt_bytes(mem.grads), "optim": fmt_bytes(mem.optimizer),
                 "activ": fmt_bytes(mem.activations), "total": fmt_bytes(mem.total),
                 "fits": "yes" if c.fits else "no", "comm/step": fmt_bytes(c.comm_bytes_per_step),
                 "step time": fmt_seconds(c.time.total)}
        table.add_row(*(cells[k] for k in keep), style="bold" if mark else None)
    out.print(table)
    if narrow:
        out.print(f"[dim]{out.width} columns: params, grads, optim, activ and comm/step left out "
                  "(a wider terminal or --json shows them)[/dim]", highlight=False)
    _print_offload(result, model, cluster, out, optimizer)
    for note in notes:
        out.print(f"[dim]note: {note}[/dim]", highlight=False)
    out.print(f"[dim]{len(result.candidates)} layouts considered: the recommended first, then the "
              f"fastest {len(shown) - 1}; memory per GPU includes framework overhead and the "
              "allocator's reserve; --json lists all[/dim]", highlight=False)


def _documents(model: Any) -> str:
    """The header's word on packed documents (attention counted within them)."""
    if model.document_len is None:
        return ""
    return f", packed documents of {model.document_len:g} tokens (attention counted within them)"


def _mfu(c: Any, model: Any, cluster: Any, result: Any) -> str:
    """Model FLOP/s per GPU and MFU the estimate implies (6N + attention, no recompute)."""
    from ..planner.steptime import flops_per_token
    tokens = result.global_batch * model.seq_len
    flops = tokens * flops_per_token(model.active_params, layers=model.layers, hidden=model.hidden,
                                     seq_len=model.attention_len,
                                     model=model if model.has_shape else None)
    per_gpu = flops / c.time.total / cluster.gpus
    return f"{per_gpu / 1e12:.0f} TFLOP/s per GPU ({per_gpu / cluster.peak_flops:.0%} MFU)"


def _print_offload(result: Any, model: Any, cluster: Any, out: Console, optimizer: str) -> None:
    """What offloading the recommended layout's optimizer (ZeRO >= 1) to host memory or NVMe
    would free per GPU and cost per step."""
    from ..planner.candidate import evaluate
    rec = result.recommended
    if rec.layout.offload != "none":
        return
    base = replace(rec.layout, zero=max(rec.layout.zero, 1), sequence_parallel=False)  # SP: not with offload
    parts = []
    for kind in ("cpu", "nvme"):
        c = evaluate(replace(base, offload=kind, offload_params=base.zero == 3), model, cluster,
                     optimizer=optimizer)
        parts.append(f"{kind} frees {fmt_bytes(rec.memory.total - c.memory.total)} per GPU for "
                     f"{fmt_seconds(c.time.total - rec.time.total)} more per step")
    out.print(f"[bold]Offload (ZeRO-{base.zero}):[/bold] {'; '.join(parts)}", highlight=False)


# ---------------------------------------------------------------- prediction
def _predict(args: argparse.Namespace) -> int:
    from trainmesh.config.train import build_train_config

    from ..planner.predict import predict_run

    prediction = predict_run(build_train_config(given_flags(args)))
    if args.json:
        print(json.dumps(prediction.to_json()))
        return 0
    _print_prediction(prediction)
    return 0


def _ops(comm: dict[str, dict[str, int]]) -> str:
    parts = [f"{axis}.{op} {fmt_size(b)}" for axis, ops in comm.items() for op, b in ops.items()]
    return ", ".join(parts) or "none"


def _hsdp(layout: dict[str, Any]) -> str:
    """`` dp_shard=S`` where HSDP shards over fewer ranks than dp."""
    shard = layout.get("dp_shard", layout["dp"])
    return f" dp_shard={shard}" if shard < layout["dp"] else ""


def _print_prediction(prediction: Any) -> None:
    out = console()
    lay = prediction.layout
    table = wide_table(f"trainmesh plan: predicted metrics, {prediction.params:,} params, "
                       f"dp={lay['dp']}{_hsdp(lay)} pp={lay['pp']} tp={lay['tp']} zero={lay['zero']} "
                       f"{lay['precision']}", ["ranks", "pp", "params", "grads", "optimizer",
                                               "comm bytes / step", "activations", "peak memory"])
    per_stage: dict[int, list[Any]] = {}
    for r in prediction.ranks:
        per_stage.setdefault(r.coords["pp"], []).append(r)
    for stage, ranks in per_stage.items():
        r = ranks[0]
        names = f"{ranks[0].rank}-{ranks[-1].rank}" if len(ranks) > 1 else str(r.rank)
        st = r.model_state_bytes
        table.add_row(names, str(stage), fmt_size(st["params"]), fmt_size(st["grads"]),
                      fmt_size(st["optimizer"]), _ops(r.comm_bytes_per_step),
                      fmt_size(r.activation_bytes), fmt_size(r.peak_mem_bytes))
    out.print(table)
    tol = prediction.tolerance
    out.print(f"[dim]tolerances: model states and traffic {tol['model_state_bytes']:.0%}, "
                  f"peak memory {tol['peak_mem_bytes']:.0%} (CPU: process RSS on this "
                  "machine's measured base); --json gives exact bytes[/dim]", highlight=False)
