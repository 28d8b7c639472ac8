#!/usr/bin/env python3
"""Mixture of experts: expert-state memory per rank against ep, tokens/s of ep 2 against ep 1.

Two parts, both on the synthetic corpus with an MoE GPT (every other block's MLP a mixture of
``--experts`` experts, top-2), fp32 AdamW:

1. **Memory and learning** (``trainmesh train`` once per layout: ``loop`` one process, the
   layer's loop over its experts; ``dp2`` ep 1; ``dp2-ep2``; with ``--world4`` also ``dp4`` and
   ``dp4-ep4``): the per-rank bytes of expert states (parameters, gradients, AdamW moments: the
   measured ``model_state_bytes`` minus the dense parameters' ``16 x dense``) and their ratio to
   ep 1 (should be 1/ep), the ep all-to-all bytes per step, the first and last loss (the model
   learns; every layout the same curve).
2. **Speed** (one 2-process job): engines for ep 1, ep 2 (both dp 2) and, on each rank, a
   one-process engine (``loop``) built side by side on the same weights; their steps interleave
   (step k of each in rotating order, a barrier before and after each), so load changes on a
   shared machine hit all alike. Prints the median step time, tokens/s and the ratio to ep 1,
   and the CPU seconds per step (process time, max over ranks), less sensitive to other load.
   ``loop`` runs the whole global batch on one rank while the other waits.
3. **ZeRO-3** (``--zero3``, instead of 1 and 2): ``trainmesh train`` at dp 4 with ep 1, 2 and 4,
   ZeRO-3: model states per rank (16 Psi / dp whatever ep: the experts are sharded over edp
   = dp / ep, each rank holding 1/ep of them), the bytes all-gathered per step on dp (at ep 1
   the experts with the dense parameters) and on edp (the experts: 1/ep of them, none at
   ep = dp), the all-to-all, the first and last loss.

    python benchmarks/bench_moe.py --steps 30
    python benchmarks/bench_moe.py --steps 30 --zero3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run(args: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainmesh", "train", *args, "--metrics-out", str(out)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return [json.loads(line) for line in out.read_text().splitlines()]


SPEED = ("ep1", "ep2", "loop")


def _speed(a: dict) -> dict:
    """One rank of the interleaved speed run (part 2 of the module docstring)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from trainmesh import Engine, ParallelConfig
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.models.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    cfg = GPTConfig(**a["gpt"])
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)

    def engine(config, mesh=None):
        return Engine(GPT(cfg, seed=0), lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                      lambda m, b: m(**b), config, mesh=mesh)
    engines = {"ep1": engine(ParallelConfig(dp=2)), "ep2": engine(ParallelConfig(dp=2, ep=2)),
               "loop": engine(ParallelConfig(), ParallelMesh(local=True))}
    rank, batch = dist.get_rank(), a["batch"]
    wall: dict[str, list[float]] = {k: [] for k in SPEED}
    cpu: dict[str, list[float]] = {k: [] for k in SPEED}
    for k in range(a["warmup"] + a["steps"]):
        whole = corpus.batch(0, k, batch)
        order = SPEED[k % 3:] + SPEED[:k % 3]
        for name in order:
            mine = whole if name == "loop" else {n: v[rank * batch // 2:(rank + 1) * batch // 2]
                                                 for n, v in whole.items()}
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if name != "loop" or rank == 0:
                engines[name].train_step(mine)
            c1 = time.process_time()
            dist.barrier()
            if k >= a["warmup"]:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in SPEED}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world4", action="store_true", help="also dp 4 and dp 4 x ep 4 (memory)")
    ap.add_argument("--speed-only", action="store_true", help="only part 2 (speed)")
    ap.add_argument("--zero3", action="store_true", help="part 3 only: ZeRO-3 at dp 4, ep 1/2/4")
    a = ap.parse_args()
    from trainmesh.models.gpt import GPTConfig
    base = ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", "4", "--seq-len", "64",
            "--vocab-size", "512", "--global-batch", "16", "--steps", str(a.steps), "--lr", "0.003",
            "--experts", str(a.experts), "--top-k", "2", "--moe-every", "2"]
    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=a.d_model, n_layers=a.layers, n_heads=4,
                    n_experts=a.experts, top_k=2, moe_every=2)
    expert_params = len(cfg.moe_blocks()) * cfg.n_experts * cfg.expert_params()
    dense = cfg.num_params() - expert_params
    if a.zero3:
        return zero3(base, a.steps)
    layouts = {"loop": [], "dp2": ["--dp", "2"], "dp2-ep2": ["--dp", "2", "--ep", "2"]}
    if a.world4:
        layouts.update({"dp4": ["--dp", "4"], "dp4-ep4": ["--dp", "4", "--ep", "4"]})
    print(f"MoE GPT: {cfg.num_params():,} parameters ({expert_params:,} in experts, "
          f"{cfg.num_params(active=True):,} active per token); {a.steps} steps, fp32 AdamW")
    print(f"{'layout':10} {'tokens/s':>9} {'vs dp2':>7} {'expert state/rank':>18} {'vs ep1':>7} "
          f"{'ep a2a B/step':>14} {'first loss':>10} {'last loss':>9}   (sequential runs)")
    tps: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in ({} if a.speed_only else layouts).items():
            records = run([*base, *flags], Path(tmp) / f"{name}.jsonl")
            steps = [r for r in records if r["event"] == "step"]
            summary = next(r for r in records if r["event"] == "summary")
            rank0 = summary["ranks"][0]
            held = sum(rank0["model_state_bytes"].values())
            expert_bytes = held - 16 * dense
            tps[name] = summary["tokens_per_s"]
            ep1 = 16 * expert_params
            a2a = rank0["comm_bytes_per_step"].get("ep", {}).get("all_to_all", 0.0)
            ratio = f"{tps[name] / tps['dp2']:.2f}x" if "dp2" in tps else "-"
            print(f"{name:10} {tps[name]:9,.0f} {ratio:>7} {expert_bytes:18,} "
                  f"{expert_bytes / ep1:6.3f}x {a2a:14,.0f} {steps[0]['loss']:10.3f} "
                  f"{steps[-1]['loss']:9.3f}")
    speed(a)


def zero3(base: list[str], steps: int) -> None:
    """Part 3 of the module docstring: dp 4 ZeRO-3 at ep 1, 2, 4 (sequential runs)."""
    print(f"{'layout':14} {'model states/rank':>17} {'dp all_gather':>13} {'edp all_gather':>14} "
          f"{'ep a2a B/step':>13} {'first loss':>10} {'last loss':>9}   ({steps} steps)")
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, 2, 4):
            name = f"dp4-ep{ep}-zero3"
            records = run([*base, "--dp", "4", "--ep", str(ep), "--zero", "3"], Path(tmp) / f"{name}.jsonl")
            losses = [r["loss"] for r in records if r["event"] == "step"]
            rank0 = next(r for r in records if r["event"] == "summary")["ranks"][0]
            comm = rank0["comm_bytes_per_step"]
            gathered = {axis: comm.get(axis, {}).get("all_gather", 0.0) for axis in ("dp", "edp")}
            a2a = comm.get("ep", {}).get("all_to_all", 0.0)
            print(f"{name:14} {sum(rank0['model_state_bytes'].values()):17,} "
                  f"{gathered['dp']:13,.0f} {gathered['edp']:14,.0f} {a2a:13,.0f} "
                  f"{losses[0]:10.3f} {losses[-1]:9.3f}")


def speed(a: argparse.Namespace) -> None:
    from trainmesh.testing import run_distributed
    gpt = dict(vocab_size=512, seq_len=64, d_model=a.d_model, n_layers=a.layers, n_heads=4,
               n_experts=a.experts, top_k=2, moe_every=2)
    res = run_distributed(_speed, 2, {"gpt": gpt, "batch": 16, "steps": a.steps, "warmup": 3},
                          timeout_s=3600)
    tokens = 16 * 64
    print(f"\nspeed, interleaved, 2 processes: {'run':6} {'median step s':>13} {'tokens/s':>9} "
          f"{'vs ep1':>7} {'CPU s/step':>10}")
    base = max(r["ep1"][0] for r in res.values())
    for name in SPEED:
        step = max(r[name][0] for r in res.values())
        cpu = max(r[name][1] for r in res.values())
        print(f"{'':32} {name:6} {step:13.4f} {tokens / step:9,.0f} {base / step:6.2f}x {cpu:10.4f}")


if __name__ == "__main__":
    main()
