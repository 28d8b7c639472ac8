"""`trainmesh plan`'s predictions against what `trainmesh train` measures, layout by layout.

For each layout, run 5 steps of the built-in GPT with --metrics-out and compare the summary's
model_state_bytes, comm_bytes_per_step and peak memory of every rank with the planner's
prediction (trainmesh.planner.predict). Prints a markdown table; exits 1 if any layout is off.

    python benchmarks/plan_vs_measured.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from trainmesh.cli import build_parser
from trainmesh.cli.train import collect
from trainmesh.config.train import build_train_config
from trainmesh.planner.predict import compare, predict_run

MODEL = ["--model", "small", "--layers", "4", "--global-batch", "8", "--steps", "5"]
LAYOUTS = [
    [], ["--dp", "2"], ["--dp", "2", "--microbatches", "2"], ["--dp", "2", "--zero", "1"],
    ["--dp", "2", "--zero", "2"], ["--dp", "2", "--zero", "3"], ["--dp", "2", "--zero", "3", "--microbatches", "2"],
    ["--tp", "2"], ["--tp", "2", "--sequence-parallel"], ["--pp", "2", "--microbatches", "4"],
    ["--dp", "2", "--recompute", "full"], ["--dp", "2", "--optimizer", "sgd"],
]


def total(bytes_by_axis: dict) -> float:
    return sum(b for ops in bytes_by_axis.values() for b in ops.values())


def main() -> int:
    rows, bad = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            args = [*MODEL, *layout]
            out = Path(tmp) / "m.jsonl"
            proc = subprocess.run([sys.executable, "-m", "trainmesh", "train", *args, "--metrics-out", str(out)],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr, file=sys.stderr)
                return 1
            measured = json.loads(out.read_text().splitlines()[-1])
            cfg = build_train_config(collect(build_parser().parse_args(["train", *args]), True))
            pred = predict_run(cfg)
            problems = compare(pred, measured)
            bad += bool(problems)
            p, m = pred.to_json()["ranks"][0], measured["ranks"][0]
            state = lambda r: sum(r["model_state_bytes"].values())   # noqa: E731
            rows.append(f"| `{' '.join(layout) or '(one process)'}` | {state(p):,} | {state(m):,} | "
                        f"{total(p['comm_bytes_per_step']):,.0f} | {total(m['comm_bytes_per_step']):,.0f} | "
                        f"{p['peak_mem_bytes'] / 2**20:,.0f} | {m['peak_mem_bytes'] / 2**20:,.0f} | "
                        f"{'ok' if not problems else '; '.join(problems)[:120]} |")
    print("| layout | model state predicted (B) | measured (B) | comm/step predicted (B) | measured (B) | "
          "peak predicted (MiB) | measured (MiB) | within tolerance |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
