#!/usr/bin/env python3
"""Mixture of experts: expert-state memory per rank against ep, tokens/s of ep against ep 1.

Runs ``trainmesh train`` on the synthetic corpus with an MoE GPT (every other block's MLP a
mixture of ``--experts`` experts, top-2), fp32 AdamW, once per layout:

- ``loop``: one process, the layer's loop over its experts (no communication);
- ``dp2``: dp 2, every rank all experts (ep 1); ``dp2-ep2``: dp 2, ep 2 (tokens by all-to-all);
- ``dp4`` / ``dp4-ep4`` (``--world4``): the memory at ep 4 (timing on 4 processes needs 4 cores).

Reports per layout: tokens/s (the run's summary), the per-rank bytes of expert states
(parameters, gradients, AdamW moments: the measured ``model_state_bytes`` minus the dense
parameters' ``16 × dense``), its ratio to ep 1 (should be 1/ep), the ep all-to-all bytes per step,
and the first and last loss (the model learns: the last well below the first).

    python benchmarks/bench_moe.py --steps 30
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world4", action="store_true", help="also dp 4 and dp 4 x ep 4 (memory)")
    a = ap.parse_args()
    from trainmesh.models.gpt import GPTConfig
    base = ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", "4", "--seq-len", "64",
            "--vocab-size", "512", "--global-batch", "16", "--steps", str(a.steps), "--lr", "0.003",
            "--experts", str(a.experts), "--top-k", "2", "--moe-every", "2"]
    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=a.d_model, n_layers=a.layers, n_heads=4,
                    n_experts=a.experts, top_k=2, moe_every=2)
    expert_params = len(cfg.moe_blocks()) * cfg.n_experts * cfg.expert_params()
    dense = cfg.num_params() - expert_params
    layouts = {"loop": [], "dp2": ["--dp", "2"], "dp2-ep2": ["--dp", "2", "--ep", "2"]}
    if a.world4:
        layouts.update({"dp4": ["--dp", "4"], "dp4-ep4": ["--dp", "4", "--ep", "4"]})
    print(f"MoE GPT: {cfg.num_params():,} parameters ({expert_params:,} in experts, "
          f"{cfg.num_params(active=True):,} active per token); {a.steps} steps, fp32 AdamW")
    print(f"{'layout':10} {'tokens/s':>9} {'vs dp2':>7} {'expert state/rank':>18} {'vs ep1':>7} "
          f"{'ep a2a B/step':>14} {'first loss':>10} {'last loss':>9}")
    tps: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in layouts.items():
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
                  f"{expert_bytes / ep1:6.3f}x {a2a:14,.0f} {steps[0]['loss']:10.3f} {steps[-1]['loss']:9.3f}")


if __name__ == "__main__":
    main()
