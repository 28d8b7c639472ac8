"""Sharded initialisation at full size: a ~200M-parameter GPT (800 MB in fp32) set up at dp 4
with ZeRO-3, at tp 2 and at pp 2; every rank's ``init_peak_mem_bytes`` must stay below the base
footprint (a one-layer one-process run) + 0.75 x the full model, with the one process's losses.

tests/test_sharded_init.py checks the same on a ~26M model; this is its full-size version
(about 150 s on 2 loaded cores: five launches of 1 step each).

    PYTHONPATH=src python benchmarks/bench_init.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_sharded_init as t  # noqa: E402

t.MODEL = ["--d-model", "1024", "--heads", "16", "--seq-len", "16", "--vocab-size", "512",
           "--optimizer", "sgd", "--global-batch", "4", "--steps", "1", "--warmup-steps", "0",
           "--force"]
t.LAYERS = 16


def main() -> None:
    t0 = time.perf_counter()
    res = t.init_peaks(Path(tempfile.mkdtemp()))
    base, full = res["base"][0][0], 4 * res["one"][2]
    print(f"params {res['one'][2]:,} ({full / 1e6:.0f} MB fp32); base {base / 1e6:.0f} MB; "
          f"bound {(base + 0.75 * full) / 1e6:.0f} MB")
    print("| run | init_peak_mem_bytes per rank (MB) | loss |\n|---|---|---|")
    for name, (peaks, losses, *_) in res.items():
        print(f"| {name} | {', '.join(f'{p / 1e6:.0f}' for p in peaks)} | {losses[0]:.6f} |")
    t.check_init_peaks(res)
    print(f"passed in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
