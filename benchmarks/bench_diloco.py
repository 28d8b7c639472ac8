"""DiLoCo against DP: loss after N steps and bytes communicated, at H = 4, 16, 64 inner steps.

Each row is one ``trainmesh train`` run (2 data-parallel replicas, the same seed, data, global
batch and AdamW recipe): plain DP, then ``--strategy diloco --inner-steps H`` with the default
outer step (Nesterov SGD, lr 0.7, momentum 0.9). N is a multiple of every H, so each DiLoCo run
ends on a synchronisation and its held-out loss is that of the averaged model. The table gives
the mean training loss of the last 8 steps, the held-out loss at step N (4 batches), and rank
0's dp bytes per step and over the run, from the ledger (DP: the gradient all-reduce; DiLoCo:
the outer all-reduce of the parameter change). Sequential runs: compare rows of one invocation.

    python benchmarks/bench_diloco.py --steps 128
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32",
         "--vocab-size", "64", "--global-batch", "16", "--warmup-steps", "10", "--lr", "0.01",
         "--dp", "2"]
H_VALUES = (4, 16, 64)


def run(args: list[str], steps: int, out: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "trainmesh", "train", *SHAPE, "--steps", str(steps),
           "--eval-every", str(steps), "--eval-batches", "4", *args, "--metrics-out", str(out)]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    return [json.loads(line) for line in out.read_text().splitlines()], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=128, help="a multiple of 64")
    a = parser.parse_args()
    layouts = {"DP": []}
    layouts.update({f"DiLoCo H={h}": ["--strategy", "diloco", "--inner-steps", str(h)]
                    for h in H_VALUES})
    print(f"| run | train loss (last 8 of {a.steps}) | held-out loss | dp bytes per step | "
          "dp bytes per run | vs DP | wall s |")
    print("|---|---|---|---|---|---|---|")
    dp_bytes = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, args) in enumerate(layouts.items()):
            records, wall = run(args, a.steps, Path(tmp) / f"{i}.jsonl")
            steps = [r for r in records if r["event"] == "step"]
            held_out = [r for r in records if r["event"] == "eval"][-1]["loss"]
            summary = next(r for r in records if r["event"] == "summary")
            per_step = sum(summary["ranks"][0]["comm_bytes_per_step"]["dp"].values())
            dp_bytes = dp_bytes or per_step
            tail = [r["loss"] for r in steps[-8:]]
            print(f"| {name} | {sum(tail) / len(tail):.4f} | {held_out:.4f} | {per_step:,.0f} | "
                  f"{per_step * len(steps):,.0f} | 1/{dp_bytes / per_step:.0f} | {wall:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
