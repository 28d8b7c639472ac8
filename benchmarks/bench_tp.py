#!/usr/bin/env python3
"""trainmesh tensor parallelism vs PyTorch DTensor tensor parallelism, same model, same run.

Both train the reference GPT (``trainmesh.models.GPT``, identical initial weights from the seed)
on the same synthetic global batches, every TP rank seeing the whole batch, world ``--world``
(gloo, one thread per process), AdamW, fp32:

- ``dtensor``: ``parallelize_module`` with ColwiseParallel q/k/v/fc, RowwiseParallel proj,
  a vocab-parallel embedding (RowwiseParallel, input Replicate) and a vocab-sharded head under
  ``loss_parallel`` — PyTorch's own tensor-parallel recipe.
- ``trainmesh``: ``trainmesh.Engine`` with ``ParallelConfig(tp=world)`` — the whole trainmesh
  step (ledger, gradient-norm measurement, loss all-reduce included).
- ``trainmesh-layers``: ``trainmesh.tensor_parallel.parallelize`` with a plain training loop,
  the layers alone (what DTensor's loop does).

Strategies interleave step by step (step k of each, in rotating order), so a load change on a
shared machine hits all of them alike; each step starts after a barrier and lasts until the
slowest rank ends; ``--rounds`` repeats the batches. Prints tokens/s (global
batch tokens over the median step time), the ratio to DTensor, and the largest per-step loss
difference between the strategies (they must agree: same weights, same batches). The CPU
seconds per step (process time, max over ranks) are less sensitive to other load on the machine.

    python benchmarks/bench_tp.py --steps 20
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

STRATEGIES = ("dtensor", "trainmesh", "trainmesh-layers")


def _batches(a: dict) -> list[dict]:
    from trainmesh.data.corpus import SyntheticCorpus
    corpus = SyntheticCorpus(a["vocab_size"], a["seq_len"])
    return [corpus.batch(a["seed"], k, a["batch"]) for k in range(a["warmup"] + a["steps"])]


def _gpt(a: dict):
    from trainmesh.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=a["vocab_size"], seq_len=a["seq_len"], d_model=a["d_model"],
                    n_layers=a["layers"], n_heads=a["heads"])
    return GPT(cfg, seed=a["seed"])


def _adamw(params, a: dict):
    import torch
    return torch.optim.AdamW(params, lr=a["lr"], weight_decay=0.0)


def _dtensor_step(a: dict, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )
    model = _gpt(a)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        parallelize_module(block, mesh, {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    parallelize_module(model, mesh, {
        "embed.wte": RowwiseParallel(input_layouts=Replicate()),
        "head.out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    opt = _adamw(model.parameters(), a)

    def step(batch: dict) -> float:
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss_sum, count = model(**batch)
            loss = loss_sum / count
            loss.backward()
        opt.step()
        return float(loss.detach().full_tensor())
    return step


def _trainmesh_step(a: dict, world: int):
    from trainmesh import Engine, ParallelConfig
    engine = Engine(_gpt(a), optimizer=lambda params: _adamw(params, a),
                    loss_fn=lambda m, b: m(**b), config=ParallelConfig(tp=world))
    return engine.train_step


def _layers_step(a: dict, world: int):
    from trainmesh.comm import Comm
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.tensor_parallel import parallelize
    mesh = ParallelMesh(tp=world)
    model = parallelize(_gpt(a), mesh, Comm(mesh))
    opt = _adamw(model.parameters(), a)

    def step(batch: dict) -> float:
        opt.zero_grad(set_to_none=True)
        loss_sum, count = model(**batch)
        loss = loss_sum / count
        loss.backward()
        opt.step()
        return float(loss.detach())
    return step


def _worker(a: dict) -> dict:
    import torch
    import torch.distributed as dist
    world = dist.get_world_size()
    batches = _batches(a)
    makers = {"dtensor": _dtensor_step, "trainmesh": _trainmesh_step, "trainmesh-layers": _layers_step}
    steps = {name: makers[name](a, world) for name in a["strategies"]}
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(a["rounds"]):
        for k, batch in enumerate(batches):
            shift = (r * len(batches) + k) % len(names)     # rotate who goes first
            for name in names[shift:] + names[:shift]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                loss = steps[name](batch)
                elapsed, used = time.perf_counter() - t0, time.process_time() - c0
                if k >= a["warmup"]:
                    times[name].append(elapsed)
                    cpu[name].append(used)
                if r == 0:
                    losses[name].append(loss)
    for table in (times, cpu):   # a step lasts until the slowest rank is done
        for name in table:
            t = torch.tensor(table[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            table[name] = t.tolist()
    return {"times": times, "cpu": cpu, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per strategy and round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per strategy and round")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the batches")
    ap.add_argument("--world", type=int, default=2, help="processes = TP degree")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list of {STRATEGIES}")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()
    a = {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "layers", "d_model", "heads",
                                        "seq_len", "vocab_size", "batch", "lr", "seed")}
    a["strategies"] = [s for s in args.strategies.split(",") if s]
    unknown = set(a["strategies"]) - set(STRATEGIES)
    if unknown:
        raise SystemExit(f"--strategies: unknown {sorted(unknown)}; valid: {', '.join(STRATEGIES)}")

    from trainmesh.testing import run_distributed
    t0 = time.time()
    result = run_distributed(_worker, args.world, a, timeout_s=300)[0]
    tokens = args.batch * args.seq_len
    rows = {}
    for name, times in result["times"].items():
        med = statistics.median(times)
        rows[name] = {"median_step_s": med, "tokens_per_s": tokens / med,
                      "median_cpu_s": statistics.median(result["cpu"][name])}
    base = rows.get("dtensor", {}).get("tokens_per_s")
    for row in rows.values():
        row["ratio_vs_dtensor"] = row["tokens_per_s"] / base if base else None
    ref = result["losses"].get("dtensor") or next(iter(result["losses"].values()))
    dloss = {name: max(abs(x - y) for x, y in zip(ls, ref)) for name, ls in result["losses"].items()}
    import torch
    summary = {"torch": torch.__version__, "world": args.world, "model": {
        k: a[k] for k in ("layers", "d_model", "heads", "seq_len", "vocab_size")}, "batch": args.batch,
        "steps": args.steps, "rounds": args.rounds, "strategies": rows, "max_abs_dloss": dloss,
        "wall_s": round(time.time() - t0, 1)}
    if args.json:
        print(json.dumps(summary))
        return
    print(f"GPT layers={args.layers} d_model={args.d_model} heads={args.heads} seq={args.seq_len} "
          f"vocab={args.vocab_size}; global batch {args.batch} ({tokens} tokens/step); world "
          f"{args.world}, 1 thread/rank, gloo, fp32 AdamW; {args.rounds} x {args.steps} timed steps "
          f"per strategy; torch {torch.__version__}")
    print(f"{'strategy':18} {'median step (s)':>16} {'tokens/s':>10} {'vs DTensor':>11} "
          f"{'CPU s/step':>11} {'max |dloss|':>12}")
    for name, row in rows.items():
        ratio = f"{row['ratio_vs_dtensor']:.2f}x" if row["ratio_vs_dtensor"] else "-"
        print(f"{name:18} {row['median_step_s']:16.4f} {row['tokens_per_s']:10,.0f} {ratio:>11} "
              f"{row['median_cpu_s']:11.4f} {dloss[name]:12.2e}")
    print(f"wall time {summary['wall_s']} s")


if __name__ == "__main__":
    main()
