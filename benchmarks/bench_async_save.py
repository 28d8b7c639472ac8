"""How long training stands still for a checkpoint: the same `trainmesh train` run with
synchronous saves and with ``--async-save``, launched one after the other, ``--repeats`` times.
Each save event's ``blocking_s`` (training stood still) and ``total_s`` (until published) are
read from the metrics file; the table gives their medians and the ratio of the stalls.

A 6.3 M-parameter GPT at dp 2 with AdamW (75 MB per checkpoint), 12 steps, a save every 2.

    python benchmarks/bench_async_save.py [--repeats 3] [--save-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = ["--layers", "2", "--d-model", "512", "--heads", "4", "--seq-len", "8", "--vocab-size", "64",
       "--global-batch", "4", "--steps", "12", "--warmup-steps", "5", "--dp", "2",
       "--save-every", "2"]


def saves(extra: list[str], root: Path) -> list[dict]:
    """The save events of one launch."""
    metrics = root / "m.jsonl"
    subprocess.run([sys.executable, "-m", "trainmesh", "train", *RUN, *extra,
                    "--save-dir", str(root / "ck"), "--metrics-out", str(metrics)],
                   check=True, capture_output=True, text=True)
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "save"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save-dir", help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    base = Path(args.save_dir or tempfile.mkdtemp(prefix="bench-async-save-"))
    events: dict[str, list[dict]] = {"sync": [], "async": []}
    for k in range(args.repeats):
        for name, extra in (("sync", []), ("async", ["--async-save"])):
            events[name] += saves(extra, base / f"{name}-{k}")
            print(f"launch {k + 1}/{args.repeats} {name}: done", file=sys.stderr, flush=True)
    med = {name: (statistics.median(e["blocking_s"] for e in ev),
                  statistics.median(e["total_s"] for e in ev)) for name, ev in events.items()}
    print("| saves | count | blocking_s (median) | total_s (median) |\n|---|---|---|---|")
    for name, (blocking, total) in med.items():
        print(f"| {name} | {len(events[name])} | {blocking:.3f} | {total:.3f} |")
    print(f"background stall / synchronous stall: {med['async'][0] / med['sync'][0]:.2f}")


if __name__ == "__main__":
    main()
