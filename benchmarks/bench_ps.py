"""Parameter server (sync, async) against DDP, and DDP with each all-reduce algorithm: tokens/s.

Each layout is one ``trainmesh train`` run of the benchmarks' common GPT shape (2 trainers /
data-parallel ranks); the table gives the median tokens/s over the steps after the first
``--skip``, the final loss and rank 0's ledger per step (ops above 0.1 MB; the backend's
all_reduce counts its payload, hand-built algorithms their real sends and receives). Runs are sequential, not
interleaved: compare rows of one invocation only.

    python benchmarks/bench_ps.py --steps 30
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = ["--layers", "4", "--d-model", "256", "--heads", "4", "--seq-len", "128",
         "--vocab-size", "1024", "--global-batch", "16", "--warmup-steps", "5"]
LAYOUTS = {
    "DDP, native all-reduce": ["--dp", "2"],
    "DDP, ring": ["--dp", "2", "--allreduce", "ring"],
    "DDP, tree": ["--dp", "2", "--allreduce", "tree"],
    "DDP, naive": ["--dp", "2", "--allreduce", "naive"],
    "PS sync, 1 server": ["--strategy", "ps", "--dp", "2", "--ps-servers", "1"],
    "PS sync, 2 servers": ["--strategy", "ps", "--dp", "2", "--ps-servers", "2"],
    "PS async, 2 servers, staleness 1": ["--strategy", "ps", "--dp", "2", "--ps-servers", "2",
                                         "--ps-mode", "async", "--ps-staleness", "1"],
}


def run(args: list[str], steps: int, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "trainmesh", "train", *SHAPE, "--steps", str(steps), *args,
           "--metrics-out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    return [json.loads(line) for line in out.read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    a = parser.parse_args()
    print("| layout | processes | median tokens/s | final loss | rank 0's ledger per step (MB) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, args) in enumerate(LAYOUTS.items()):
            records = run(args, a.steps, Path(tmp) / f"{i}.jsonl")
            steps = [r for r in records if r["event"] == "step"][a.skip:]
            summary = next(r for r in records if r["event"] == "summary")
            ledger = summary["ranks"][0]["comm_bytes_per_step"]
            sent = ", ".join(f"{axis}.{op} {b / 1e6:.1f}" for axis, ops in ledger.items()
                             for op, b in ops.items() if b > 1e5)
            print(f"| {name} | {summary['world_size']} | "
                  f"{statistics.median(r['tokens_per_s'] for r in steps):,.0f} | "
                  f"{summary['final_loss']:.4f} | {sent} |", flush=True)


if __name__ == "__main__":
    main()
