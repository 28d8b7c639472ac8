#!/usr/bin/env python3
"""trainmesh's composed layouts against PyTorch's own composition of the same axes, same run.

Each layout launches its processes once (gloo, one thread per process); every process builds
both sides from the same GPT (trainmesh's reference model, same seed: identical initial
weights), and they alternate steps on the same global batches (each step after a barrier and
until the slowest rank ends; the order flips every step), so load on a shared machine hits
both alike. AdamW, fp32, no gradient clipping on either side.

- ``zero3`` (2 processes): ``--dp 2 --zero 3`` against ``fully_shard`` over a 1-D dp mesh.
- ``zero3-tp`` (4 processes): ``--dp 2 --tp 2 --zero 3`` against ``fully_shard`` over the dp
  dimension of a (dp, tp) DeviceMesh after ``parallelize_module`` (ColwiseParallel q/k/v/fc,
  RowwiseParallel proj, vocab-parallel embedding and head under ``loss_parallel``).
- ``hsdp-tp`` (8): ``--dp 4 --dp-shard 2 --tp 2 --zero 3`` against ``fully_shard`` over the
  (replicate, shard) dimensions of a (replicate, shard, tp) mesh, same tensor-parallel plan.
- ``zero3-tp-pp`` (8): ``--dp 2 --tp 2 --pp 2 --zero 3`` 1F1B against
  ``torch.distributed.pipelining`` ``Schedule1F1B`` over stages that are FSDP2 + DTensor
  modules (the head's logits gathered over tp at the stage boundary).
- ``cp-zero3`` (2): ``--cp 2 --zero 3`` against ``context_parallel`` + ``fully_shard``; where
  PyTorch's side does not run, its error's first line is printed and only trainmesh is timed.

Per layout: tokens/s of each side (global batch tokens over the median step), the ratio
trainmesh / PyTorch of each of ``--runs`` timed passes and their median; peak memory per rank
(held parameters, gradients and optimizer state — and a pipelining stage's receive buffers,
which it keeps from step to step — plus the profiler's peak of one step's allocations); payload bytes per step and rank (trainmesh: its ledger; PyTorch: counted by
wrapping torch.distributed's collectives, ``TorchCommMeter``); the exposed communication (the
seconds the step's thread is blocked in a collective, per axis, over the step time: trainmesh's
ledger books them per op, PyTorch's side is timed by the same wrapper); and the largest loss
difference over every step; whether the peak is within 5% of PyTorch's and whether the blocked
share on each data-parallel axis is at most PyTorch's. ``--zero3-reshard microbatch`` frees
trainmesh's ZeRO-3 units after every forward and backward under pp (as FSDP2 does). Each
layout's last line ends ``ratio X.XXx``.

    python benchmarks/bench_composed.py                       # all five layouts
    python benchmarks/bench_composed.py --layouts zero3-tp --steps 6 --runs 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

LAYOUTS = {   # name: (processes, trainmesh's ParallelConfig fields)
    "zero3": (2, {"dp": 2, "zero": 3}),
    "zero3-tp": (4, {"dp": 2, "tp": 2, "zero": 3}),
    "hsdp-tp": (8, {"dp": 4, "dp_shard": 2, "tp": 2, "zero": 3}),
    "zero3-tp-pp": (8, {"dp": 2, "tp": 2, "pp": 2, "zero": 3, "schedule": "1f1b"}),
    "cp-zero3": (2, {"cp": 2, "zero": 3}),
}
LOSS_TOLERANCE = 1e-3
"""Largest loss difference between the sides: trainmesh's promise for any layout against one
process (same weights, same batches; fp32 sums in other orders differ by far less)."""
PEAK_TOLERANCE = 1.05
"""trainmesh's peak per rank may be at most this times PyTorch's composition's."""
DP_AXES = ("dp", "dp_shard", "dp_replicate")
"""The data-parallel (ZeRO-3, HSDP) axes whose blocked share is compared."""
TORCH_AXES = {"replicate": "dp_replicate", "shard": "dp_shard"}
"""PyTorch's mesh dimension names -> trainmesh's axis names (the others are the same)."""


def _gpt(a: dict):
    from trainmesh.models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=a["vocab"], seq_len=a["seq"], d_model=a["d_model"],
                         n_layers=a["layers"], n_heads=a["heads"]), seed=0)


def _adamw(params, a: dict):
    import torch
    return torch.optim.AdamW(params, lr=a["lr"])


def _tp_block(block, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parallelize_module(block, tp_mesh, {
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})


def _tp_ends(module, tp_mesh, *, gather_logits: bool) -> None:
    """The whole GPT's, or a pipeline layer's, embedding vocab-parallel (RowwiseParallel, input
    Replicate) and head vocab-sharded for ``loss_parallel`` or its logits gathered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    head = (ColwiseParallel(output_layouts=Replicate()) if gather_logits
            else ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    if hasattr(module, "embed"):
        plan = {"embed.wte": RowwiseParallel(input_layouts=Replicate()), "head.out": head}
    elif hasattr(module, "wte"):
        plan = {"wte": RowwiseParallel(input_layouts=Replicate())}
    else:
        plan = {"out": head}
    parallelize_module(module, tp_mesh, plan)


def _world_mean(loss, n: int) -> float:
    import torch
    import torch.distributed as dist
    total = loss.detach().clone().reshape(1).to(torch.float64)
    dist.all_reduce(total)
    return float(total) / n


def _torch_fsdp_tp(a: dict, mesh, dp_dims: tuple[str, ...]):
    """FSDP2 over ``dp_dims`` of ``mesh`` after DTensor TP over its ``tp`` dimension."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    model = _gpt(a)
    for block in model.blocks:
        _tp_block(block, mesh["tp"])
    _tp_ends(model, mesh["tp"], gather_logits=False)
    dp_mesh = mesh[dp_dims]
    for unit in (model.embed, *model.blocks, model.head):
        fully_shard(unit, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = _adamw(model.parameters(), a)
    world = mesh.size()

    def step(batch: dict) -> float:
        with loss_parallel():
            loss_sum, count = model(**batch)
            loss = loss_sum / count
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return _world_mean(loss, world)
    return model, opt, step


def _torch_pp(a: dict, mesh):
    """pipelining Schedule1F1B over stages that are FSDP2 (dp) + DTensor TP (tp) modules."""
    import torch
    import torch.distributed.pipelining as P
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from trainmesh.pipeline_parallel.partition import named_pipeline_layers, partition
    pp_i, pp = mesh.get_local_rank("pp"), mesh.size(0)
    layers = [layer for _, layer in partition(named_pipeline_layers(_gpt(a)), pp)[pp_i]]
    for layer in layers:
        if hasattr(layer, "attn"):
            _tp_block(layer, mesh["tp"])
        else:
            _tp_ends(layer, mesh["tp"], gather_logits=True)
        fully_shard(layer, mesh=mesh["dp"])
    module = nn.Sequential(*layers)
    fully_shard(module, mesh=mesh["dp"])
    stage = P.PipelineStage(module, pp_i, pp, torch.device("cpu"), group=mesh["pp"].get_group())

    def ce(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    sched = P.Schedule1F1B(stage, n_microbatches=a["microbatches"], loss_fn=ce)
    opt = _adamw(module.parameters(), a)
    world, last = mesh.size(), pp_i == pp - 1

    def step(batch: dict) -> float:
        losses: list = []
        if pp_i == 0:
            sched.step(batch["input_ids"])
        else:
            sched.step(target=batch["labels"], losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mine = torch.stack([x.detach() for x in losses]).mean() if last else torch.zeros(())
        return _world_mean(mine, world // pp)

    def receive_buffers() -> list:
        """The stage's receive buffers (activations, gradients): allocated at its first step
        and kept from step to step, so held between steps as the parameters are."""
        infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
        return [ri.buffer for group in infos for ri in (group if isinstance(group, (tuple, list)) else (group,))
                if isinstance(getattr(ri, "buffer", None), torch.Tensor)]
    step.receive_buffers = receive_buffers
    return module, opt, step


def _torch_fsdp(a: dict, mesh, probe: dict):
    """fully_shard over the 1-D mesh (dp; cp: under context_parallel, raising where it can't run)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import context_parallel
    model = _gpt(a)
    for unit in (model.embed, *model.blocks, model.head, model):     # the root last
        fully_shard(unit, mesh=mesh)
    opt, cp = _adamw(model.parameters(), a), mesh.mesh_dim_names == ("cp",)

    def backward(batch: dict):
        ids, labels = (t.clone() if cp else t for t in (batch["input_ids"], batch["labels"]))
        with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]) if cp else nullcontext():
            loss_sum, count = model(ids, labels)
            loss = loss_sum / count
            loss.backward()
        return loss

    def step(batch: dict) -> float:
        loss = backward(batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _world_mean(loss, mesh.size())
    backward(probe)          # the error, if any, before any timing (no step taken)
    opt.zero_grad(set_to_none=True)
    return model, opt, step


def _torch_side(layout: str, a: dict, probe: dict):
    from torch.distributed.device_mesh import init_device_mesh
    if layout == "zero3-tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return mesh, _torch_fsdp_tp(a, mesh, ("dp",))
    if layout == "hsdp-tp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        return mesh, _torch_fsdp_tp(a, mesh, ("replicate", "shard"))
    if layout == "zero3-tp-pp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        return mesh, _torch_pp(a, mesh)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp" if layout == "zero3" else "cp",))
    return mesh, _torch_fsdp(a, mesh, probe)


def _worker(layout: str, a: dict) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    from common import TorchCommMeter, local_bytes, mesh_axes, step_alloc_peak

    import trainmesh as tm
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    warnings.filterwarnings("ignore", message=".*returned a view tensor")   # FSDP2 on the
    _, fields = LAYOUTS[layout]                            # stages' outputs: none is changed in place
    pp = {"microbatches": a["microbatches"], "zero3_reshard": a["zero3_reshard"]} if "pp" in fields else {}
    cfg = tm.ParallelConfig(**fields, **pp)
    engine = tm.Engine(_gpt(a), optimizer=lambda ps: _adamw(ps, a), loss_fn=lambda m, b: m(**b),
                       config=cfg, broadcast_init=False)
    dp_i, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    corpus = SyntheticCorpus(a["vocab"], a["seq"])
    n_steps = a["warmup"] + a["runs"] * a["steps"] + 1          # + 1: the memory step
    batches = [dp_slice(corpus.batch(0, k, a["batch"]), dp_i, dp) for k in range(n_steps)]
    sides: dict = {"trainmesh": engine.train_step}
    torch_error, meter = None, None
    try:
        mesh, (t_model, t_opt, t_step) = _torch_side(layout, a, dict(batches[0]))
        sides["torch"] = t_step
        meter = TorchCommMeter(mesh_axes(mesh, TORCH_AXES))
        if layout == "zero3":   # dp's ranks are the world's; FSDP2's only all-reduce: the loss's
            meter._book = lambda ax, op, *r, b=meter._book: b("world" if op == "all_reduce" else "dp", op, *r)
    except Exception as exc:     # noqa: BLE001 (reported: PyTorch's composition cannot run here)
        torch_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    times = {s: [] for s in sides}
    cpu = {s: [] for s in sides}                   # process seconds (gloo's threads included)
    losses = {s: [] for s in sides}
    exposed = {s: {} for s in sides}              # axis -> blocked seconds over the timed steps
    tm_bytes: dict = {}
    for k in range(n_steps - 1):
        order = list(sides) if k % 2 == 0 else list(reversed(sides))
        for side in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if side == "torch":
                meter.reset()
                meter.start()
            loss = sides[side](batches[k])
            if side == "torch":
                meter.stop()
            dist.barrier()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if side == "torch":
                blocked = dict(meter.seconds)
                t_bytes = {ax: dict(ops) for ax, ops in meter.bytes.items()}
            else:
                window = engine.last_step_traffic()
                blocked = {ax: sum(s.seconds for s in ops.values()) for ax, ops in window.items()}
                tm_bytes = {ax: {op: s.bytes for op, s in ops.items()} for ax, ops in window.items()}
            losses[side].append(loss)
            if k >= a["warmup"]:
                times[side].append(dt)
                cpu[side].append(dc)
                for ax, sec in blocked.items():
                    exposed[side][ax] = exposed[side].get(ax, 0.0) + sec
    # the memory step: held state + the profiler's peak of one step's allocations
    last = batches[-1]
    state = engine.measure_state()
    peak = {"trainmesh": (sum(state.values()), step_alloc_peak(lambda: engine.train_step(last)))}
    receive_bytes = 0
    if "torch" in sides:
        receive = getattr(t_step, "receive_buffers", list)    # pipelining's stage buffers
        before = {b.untyped_storage().data_ptr() for b in receive()}
        step_peak = step_alloc_peak(lambda: t_step(last))
        kept = [b for b in receive() if b.untyped_storage().data_ptr() in before]   # not the step's
        held = local_bytes([*t_model.parameters(), *(p.grad for p in t_model.parameters()),
                            *(v for st in t_opt.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor)), *kept])
        peak["torch"] = (held, step_peak)
        receive_bytes = local_bytes(kept)
    out = {"times": times, "cpu": cpu, "losses": losses, "exposed": exposed, "peak": peak,
           "torch_receive_bytes": receive_bytes,
           "comm_buffer_peak": engine.comm_buffer_peak_bytes, "bytes": {"trainmesh": tm_bytes},
           "torch_error": torch_error, "rank": dist.get_rank()}
    if "torch" in sides:
        out["bytes"]["torch"] = t_bytes
    return out


def _summary(layout: str, a: dict, ranks: dict[int, dict]) -> dict:
    """Every rank's records -> the layout's figures (step time: the slowest rank's)."""
    r0 = ranks[0]
    sides = list(r0["times"])
    step = {s: [max(r["times"][s][i] for r in ranks.values()) for i in range(len(r0["times"][s]))]
            for s in sides}
    tokens = a["batch"] * a["seq"]
    n = a["steps"]
    runs = {s: [statistics.median(step[s][i * n:(i + 1) * n]) for i in range(a["runs"])] for s in sides}
    out: dict = {"layout": layout, "processes": len(ranks), "torch_error": r0["torch_error"],
                 "tokens_per_s": {s: tokens / statistics.median(step[s]) for s in sides},
                 "peak_mib_max_rank": {s: max(sum(r["peak"][s]) for r in ranks.values()) / 2**20
                                       for s in sides},
                 "held_and_step_mib_rank0": {s: [b / 2**20 for b in r0["peak"][s]] for s in sides},
                 "torch_receive_mib_max_rank": max(r["torch_receive_bytes"] for r in ranks.values()) / 2**20,
                 "bytes_per_step_rank0": r0["bytes"]}
    if "torch" in sides:
        ratios = [t / m for m, t in zip(runs["trainmesh"], runs["torch"])]
        out["ratios"] = ratios
        out["ratio"] = statistics.median(ratios)
        pairs = zip(r0["losses"]["trainmesh"], r0["losses"]["torch"])
        out["max_abs_dloss"] = max(abs(x - y) for x, y in pairs)
    share = {}
    for s in sides:       # per axis: blocked seconds over step seconds, mean over ranks
        axes = sorted({ax for r in ranks.values() for ax in r["exposed"][s]})
        share[s] = {ax: statistics.mean(r["exposed"][s].get(ax, 0.0) / sum(r["times"][s])
                                        for r in ranks.values()) for ax in axes}
    out["exposed_share"] = share
    out["exposed_ms_per_step"] = {s: {ax: 1e3 * statistics.mean(
        r["exposed"][s].get(ax, 0.0) / len(r["times"][s]) for r in ranks.values())
        for ax in share[s]} for s in sides}
    out["step_ms"] = {s: 1e3 * statistics.median(step[s]) for s in sides}
    out["cpu_s_per_step_all_ranks"] = {s: statistics.median(
        sum(r["cpu"][s][i] for r in ranks.values()) for i in range(len(r0["cpu"][s]))) for s in sides}
    out["trainmesh_comm_buffer_peak_mib"] = max(r["comm_buffer_peak"] for r in ranks.values()) / 2**20
    return out


def _fmt_bytes(by_axis: dict) -> str:
    return "; ".join(f"{ax} " + ", ".join(f"{op} {b / 2**10:,.0f}K" for op, b in sorted(ops.items()))
                     for ax, ops in sorted(by_axis.items()) if ops) or "-"


def _print(s: dict, a: dict) -> None:
    tps = s["tokens_per_s"]
    print(f"\n## {s['layout']} ({s['processes']} processes)")
    for side in tps:
        ms = s["exposed_ms_per_step"][side]
        blocked = ", ".join(f"{ax} {v:.0%} ({ms[ax]:.1f} ms)"
                            for ax, v in s["exposed_share"][side].items() if v >= 0.005)
        held, transient = s["held_and_step_mib_rank0"][side]
        print(f"- {side}: {tps[side]:,.0f} tokens/s ({s['step_ms'][side]:.1f} ms/step; CPU "
              f"{s['cpu_s_per_step_all_ranks'][side]:.2f} s/step, all ranks)\n"
              f"  peak {s['peak_mib_max_rank'][side]:.2f} MiB (largest rank; rank 0: held "
              f"{held:.2f} + step {transient:.2f})\n"
              f"  bytes/step, rank 0: {_fmt_bytes(s['bytes_per_step_rank0'][side])}\n"
              f"  blocked in collectives (share of the step, mean over ranks): {blocked or 'none'}")
    print(f"- trainmesh's transient communication buffers (gathered units, buckets): peak "
          f"{s['trainmesh_comm_buffer_peak_mib']:.2f} MiB (largest rank)")
    if s.get("torch_receive_mib_max_rank"):
        print(f"- PyTorch's pipeline stage receive buffers, kept between steps (in its held "
              f"state): {s['torch_receive_mib_max_rank']:.2f} MiB (largest rank)")
    if "torch" in tps:
        pk, sh, ms = s["peak_mib_max_rank"], s["exposed_share"], s["exposed_ms_per_step"]
        ratio = pk["trainmesh"] / pk["torch"]
        print(f"- peak per rank: trainmesh / PyTorch {ratio:.3f} "
              f"({'within' if ratio <= PEAK_TOLERANCE else 'ABOVE'} {PEAK_TOLERANCE})")
        for ax in (x for x in DP_AXES if x in sh["torch"]):
            mine, theirs = sh["trainmesh"].get(ax, 0.0), sh["torch"][ax]
            print(f"- {ax} blocked share: trainmesh {mine:.1%} ({ms['trainmesh'].get(ax, 0.0):.1f} ms), "
                  f"PyTorch {theirs:.1%} ({ms['torch'][ax]:.1f} ms): "
                  + ("at most PyTorch's" if mine <= theirs else "ABOVE PyTorch's"))
    if "ratio" in s:
        verdict = "within" if s["max_abs_dloss"] <= LOSS_TOLERANCE else "ABOVE"
        print(f"- max |loss difference| over {len(s['ratios']) * a['steps'] + a['warmup']} steps: "
              f"{s['max_abs_dloss']:.1e} ({verdict} {LOSS_TOLERANCE:g}); ratio of each run: "
              + ", ".join(f"{r:.2f}" for r in s["ratios"]))
        print(f"{s['layout']}: trainmesh {tps['trainmesh']:,.0f} tokens/s, PyTorch "
              f"{tps['torch']:,.0f} tokens/s, ratio {s['ratio']:.2f}x")
    else:
        print(f"{s['layout']}: trainmesh {tps['trainmesh']:,.0f} tokens/s; PyTorch's composition "
              f"does not run here ({s['torch_error']}); ratio n/a")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side in each run")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (the ratio is their median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", dest="d_model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches (zero3-tp-pp)")
    ap.add_argument("--zero3-reshard", dest="zero3_reshard", default="step",
                    help="trainmesh's ZeRO-3 under pp (zero3-tp-pp): units gathered once per step "
                         "(default) or before every forward and backward, as FSDP2 does")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", dest="json_out", help="also write the summaries here")
    ap.add_argument("--dry-run", action="store_true",
                    help="check the arguments, print the plan, launch nothing")
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        ap.exit(2, f"--layouts: unknown {unknown or 'none given'}; valid: {', '.join(LAYOUTS)}\n")
    for name in ("steps", "runs", "batch", "microbatches", "layers", "d_model", "heads", "seq", "vocab"):
        if getattr(args, name) < 1:
            ap.exit(2, f"--{name.replace('_', '-')}: must be >= 1; got {getattr(args, name)}\n")
    if args.zero3_reshard not in ("step", "microbatch"):
        ap.exit(2, f"--zero3-reshard: step or microbatch; got {args.zero3_reshard}\n")
    if args.warmup < 0:
        ap.exit(2, f"--warmup: must be >= 0; got {args.warmup}\n")
    for name in layouts:
        fields = LAYOUTS[name][1]
        dp = fields.get("dp", 1)
        rows = args.batch // dp if args.batch % dp == 0 else 0
        if not rows or ("pp" in fields and rows % args.microbatches):
            ap.exit(2, f"--batch: {name} needs a multiple of dp ({dp})"
                       + (f" x microbatches ({args.microbatches})" if "pp" in fields else "")
                       + f"; got {args.batch}\n")
    shape = [("heads", args.heads % 2, "must be even (tp 2 splits the heads)"),
             ("d-model", args.d_model % args.heads, f"must be a multiple of --heads ({args.heads})"),
             ("seq", args.seq % 4, "must be a multiple of 4 (cp 2: 4 zigzag chunks)"),
             ("vocab", args.vocab % 2, "must be even (tp 2 splits the vocabulary)")]
    for flag, bad, rule in shape:
        if bad:
            ap.exit(2, f"--{flag}: {rule}; got {getattr(args, flag.replace('-', '_'))}\n")
    a = vars(args)
    plan = ", ".join(f"{n} ({LAYOUTS[n][0]} processes)" for n in layouts)
    print(f"GPT layers={args.layers} d_model={args.d_model} heads={args.heads} seq={args.seq} "
          f"vocab={args.vocab}; global batch {args.batch} ({args.batch * args.seq} tokens/step); "
          f"{args.runs} runs x {args.steps} timed steps per side after {args.warmup}; {plan}")
    if args.dry_run:
        return
    import torch

    from trainmesh.testing import run_distributed
    print(f"gloo, 1 thread/process, fp32 AdamW, torch {torch.__version__}")
    summaries = []
    for name in layouts:
        t0 = time.time()
        ranks = run_distributed(_worker, LAYOUTS[name][0], name, a, timeout_s=900)
        s = _summary(name, a, ranks)
        s["wall_s"] = round(time.time() - t0, 1)
        summaries.append(s)
        _print(s, a)
        sys.stdout.flush()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": a, "layouts": summaries}, indent=1))


if __name__ == "__main__":
    main()
