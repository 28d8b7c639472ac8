#!/usr/bin/env python3
"""trainmesh pipeline parallelism vs torch.distributed.pipelining, same model, same run.

World 2 (one pipeline stage per process), gloo, one thread per process. Both sides train the
same GPT (trainmesh's reference model, same seed), cut at the same layer (trainmesh's
parameter-balanced partition), with AdamW, on the same batches, GPipe and 1F1B. Rounds alternate
between the four variants so load changes on a shared machine hit them alike. Step time is the
slowest rank's; tokens/s = global batch * seq / median step time (the minimum, less
sensitive to other load on a shared machine, is shown too, and so is the CPU time per step).

Also reports the measured bubble of trainmesh's last step (from its timeline: idle over
makespan, mean over ranks) against the theory (p-1)/(m+p-1), which assumes backward = 2 x
forward and free communication.

    python benchmarks/bench_pp.py                      # defaults below
    python benchmarks/bench_pp.py --layers 4 --d-model 256 --seq 128 --batch 16 --microbatches 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import gpt_round_arguments  # noqa: E402

VARIANTS = [("trainmesh", "gpipe"), ("native", "gpipe"), ("trainmesh", "1f1b"), ("native", "1f1b")]


def _model(args):
    from trainmesh.models.gpt import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                         n_layers=args.layers, n_heads=args.heads), seed=0)


def _trainmesh_step_fn(args, schedule: str):
    import torch

    import trainmesh as tm
    cfg = tm.ParallelConfig(pp=2, microbatches=args.microbatches, schedule=schedule)
    engine = tm.Engine(_model(args), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                       loss_fn=lambda m, b: m(**b), config=cfg, broadcast_init=False)
    return engine, (lambda batch: engine.train_step(batch))


def _native_step_fn(args, schedule: str):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as P
    import torch.nn.functional as F
    from torch import nn

    from trainmesh.pipeline_parallel.partition import named_pipeline_layers, partition

    rank = dist.get_rank()
    stages = partition(named_pipeline_layers(_model(args)), 2)
    module = nn.Sequential(*[layer for _, layer in stages[rank]])
    stage = P.PipelineStage(module, rank, 2, torch.device("cpu"))
    cls = P.Schedule1F1B if schedule == "1f1b" else P.ScheduleGPipe

    def ce(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    sched = cls(stage, n_microbatches=args.microbatches, loss_fn=ce)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(batch["input_ids"])
        else:
            sched.step(target=batch["labels"], losses=[])
        opt.step()
    return None, step


def bench_worker(args) -> dict:
    import torch
    import torch.distributed as dist

    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.pipeline_parallel.analysis import bubble_fraction
    from trainmesh.pipeline_parallel.timeline import gather_timeline

    data = SyntheticCorpus(args.vocab, args.seq)
    runners = {}
    for side, schedule in VARIANTS:
        build = _trainmesh_step_fn if side == "trainmesh" else _native_step_fn
        runners[(side, schedule)] = build(args, schedule)
    times: dict = {v: [] for v in VARIANTS}
    cpu: dict = {v: [] for v in VARIANTS}
    step_no = 0
    for rnd in range(args.warmup_rounds + args.rounds):
        for v in VARIANTS:
            _, step = runners[v]
            for _ in range(args.steps):
                batch = data.batch(0, step_no, args.batch)
                step_no += 1
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                step(batch)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dc = torch.tensor([time.process_time() - c0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                dist.all_reduce(dc)
                if rnd >= args.warmup_rounds:
                    times[v].append(float(dt))
                    cpu[v].append(float(dc))
    bubbles = {}
    for schedule in ("gpipe", "1f1b"):
        engine = runners[("trainmesh", schedule)][0]
        tl = gather_timeline(engine.executor, engine.comm)
        if tl is not None:
            bubbles[schedule] = {"measured": bubble_fraction(tl), "makespan_s": tl.makespan,
                                 "busy_s": [tl.busy(r) for r in range(tl.pp)]}
    return {"times": {f"{a}/{b}": t for (a, b), t in times.items()},
            "cpu": {f"{a}/{b}": t for (a, b), t in cpu.items()}, "bubbles": bubbles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpt_round_arguments(ap, layers=4, vocab=1024, rounds=20)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    args = ap.parse_args()

    from trainmesh.testing import run_distributed
    t0 = time.time()
    res = run_distributed(bench_worker, 2, args, timeout_s=600)[0]
    tokens = args.batch * args.seq
    p, m = 2, args.microbatches
    print(f"GPT layers={args.layers} d_model={args.d_model} heads={args.heads} seq={args.seq} "
          f"vocab={args.vocab}; global batch {args.batch} ({tokens} tokens/step), {m} microbatches, "
          f"pp=2, gloo, 1 thread/process; {args.rounds} rounds x {args.steps} steps per variant "
          f"({time.time() - t0:.0f}s)\n")
    print("| schedule | trainmesh tokens/s | torch.distributed.pipelining tokens/s | ratio | "
          "trainmesh step median / min (s) | native step median / min (s) | ratio of minima |")
    print("|---|---|---|---|---|---|---|")
    for schedule in ("gpipe", "1f1b"):
        ours, theirs = res["times"][f"trainmesh/{schedule}"], res["times"][f"native/{schedule}"]
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"| {schedule} | {tokens / o:,.0f} | {tokens / t:,.0f} | {t / o:.2f}x | "
              f"{o:.4f} / {min(ours):.4f} | {t:.4f} / {min(theirs):.4f} | "
              f"{min(theirs) / min(ours):.2f}x |")
    print("\nCPU seconds per step, both processes together (process_time, incl. gloo threads; "
          "insensitive to other load): " + "; ".join(
              f"{k} {statistics.median(v):.3f}" for k, v in res["cpu"].items()))
    theory = (p - 1) / (m + p - 1)
    print(f"\nbubble of trainmesh's last step (measured timeline) vs theory (p-1)/(m+p-1) = {theory:.3f}:")
    for schedule, b in res["bubbles"].items():
        print(f"  {schedule}: measured {b['measured']:.3f} (makespan {b['makespan_s'] * 1e3:.1f} ms, "
              f"busy per rank {', '.join(f'{x * 1e3:.1f}' for x in b['busy_s'])} ms)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), **res}, indent=1))


if __name__ == "__main__":
    main()
