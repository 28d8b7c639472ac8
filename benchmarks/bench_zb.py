#!/usr/bin/env python3
"""Measured pipeline bubble: zero-bubble ``zb1p`` against ``1f1b``, same p and m.

World p (one pipeline stage per process), gloo, one thread per process. Both schedules train the
built-in GPT with equal stages (``--layers`` a multiple of p and a small vocabulary, so the
embedding and the head weigh little next to a block), AdamW, on the same batches; rounds
alternate between them so load changes on a shared machine hit both alike. After every timed
step the measured timeline (each action's start and end, waiting for data counted as idle) is
gathered and its bubble fraction taken (idle over makespan, mean over ranks); the table gives
the median over the rounds, the step time and the schedules' own cost-model bubble.

    python benchmarks/bench_zb.py --pp 2 --microbatches 8
    python benchmarks/bench_zb.py --pp 4 --microbatches 8
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

SCHEDULES = ("1f1b", "zb1p")


def _engine(args, schedule: str):
    import torch

    import trainmesh as tm
    from trainmesh.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                          n_layers=args.layers, n_heads=args.heads), seed=0)
    cfg = tm.ParallelConfig(pp=args.pp, microbatches=args.microbatches, schedule=schedule)
    return tm.Engine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                     loss_fn=lambda m, b: m(**b), config=cfg, broadcast_init=False)


def bench_worker(args) -> dict:
    import torch.distributed as dist

    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.pipeline_parallel.analysis import bubble_fraction
    from trainmesh.pipeline_parallel.timeline import gather_timeline

    data = SyntheticCorpus(args.vocab, args.seq)
    engines = {s: _engine(args, s) for s in SCHEDULES}
    out: dict = {s: {"bubble": [], "step_s": []} for s in SCHEDULES}
    step_no = 0
    for rnd in range(args.warmup_rounds + args.rounds):
        for s in SCHEDULES:
            batch = data.batch(0, step_no, args.batch)
            step_no += 1
            dist.barrier()
            t0 = time.perf_counter()
            engines[s].train_step(batch)
            dt = time.perf_counter() - t0
            tl = gather_timeline(engines[s].executor, engines[s].comm)
            if tl is not None and rnd >= args.warmup_rounds:
                out[s]["bubble"].append(bubble_fraction(tl))
                out[s]["step_s"].append(dt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    gpt_round_arguments(ap, layers=8, vocab=64, rounds=10)
    args = ap.parse_args()

    from trainmesh.pipeline_parallel import bubble_fraction, build_schedule, simulate
    from trainmesh.testing import run_distributed
    res = run_distributed(bench_worker, args.pp, args, timeout_s=600)[0]
    print(f"pp {args.pp}, m {args.microbatches}, GPT {args.layers} layers d {args.d_model} seq "
          f"{args.seq} vocab {args.vocab}, global batch {args.batch}, {args.rounds} rounds\n")
    print("| schedule | measured bubble (median) | min-max | step (s, median) | cost-model bubble |")
    print("|---|---|---|---|---|")
    for s in SCHEDULES:
        b, t = res[s]["bubble"], res[s]["step_s"]
        model = bubble_fraction(simulate(build_schedule(s, args.pp, args.microbatches)))
        print(f"| {s} | {statistics.median(b):.3f} | {min(b):.3f}-{max(b):.3f} | "
              f"{statistics.median(t):.3f} | {model:.3f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": res}, indent=1))


if __name__ == "__main__":
    main()
