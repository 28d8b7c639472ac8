"""Data that scales: a large text file trains at dp 2 without any process holding it.

Writes ``--size-mb`` MB of synthetic text (random words, in 1 MB blocks) into a temporary
directory, runs ``trainmesh train --dp 2 --data FILE`` on it and, as the baseline, the same run on
``--data synthetic``; while each runs, polls every process of the job (the launcher and its
workers) for its peak resident memory (``VmHWM`` in ``/proc/PID/status``). The growth of a
process is its peak on the text run minus the same process's peak on the synthetic run; the
benchmark reports it as a fraction of the file's size and deletes the file. Linux only.

    python benchmarks/bench_data.py                        # 300 MB, bytes, 20 steps
    python benchmarks/bench_data.py --size-mb 100 --tokenizer bpe:512
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from trainmesh.testing import worker_pids

WORDS = np.array(["the", "rank", "shard", "gather", "pipeline", "bubble", "gradient", "optimizer",
                  "token", "layer", "tensor", "parallel", "memory", "offload", "stage", "ring"])
MODEL = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "64", "--vocab-size", "256",
         "--global-batch", "8", "--warmup-steps", "2"]


def write_text(path: Path, size_mb: int) -> int:
    """``size_mb`` blocks of 1 MB of random words and newlines; the file's size in bytes."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(size_mb):
            words = WORDS[rng.integers(0, len(WORDS), 200_000)]
            words[rng.integers(0, len(words), 15_000)] = "\n"
            f.write(" ".join(words)[: 1 << 20])
    return path.stat().st_size


def _hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_job(args: list[str], tmp: Path) -> dict:
    """Run ``trainmesh train ARGS``; {"launcher": peak, "workers": [peaks by pid order], "s": wall}."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "trainmesh", "train", *args,
                             "--metrics-out", str(tmp / "m.jsonl")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for pid in [proc.pid, *worker_pids(proc.pid)]:
                hwm = _hwm(pid)
                if hwm is not None:
                    peaks[pid] = max(peaks.get(pid, 0), hwm)
            time.sleep(0.05)
    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    done.set()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"trainmesh train {' '.join(args)} exited {proc.returncode}: {err[-2000:]}")
    workers = [peaks[p] for p in sorted(peaks) if p != proc.pid]   # started in rank order
    return {"launcher": peaks[proc.pid], "workers": workers, "s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokenizer", default="bytes")
    ap.add_argument("--json", dest="json_out", help="also write the raw results here")
    a = ap.parse_args()
    run = ["--dp", "2", "--steps", str(a.steps), "--eval-every", str(a.steps)]
    model = MODEL if a.tokenizer == "bytes" else [x for x in MODEL if x not in ("--vocab-size", "256")]
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp_dir:
        tmp = Path(tmp_dir)
        path = tmp / "corpus.txt"
        t0 = time.perf_counter()
        size = write_text(path, a.size_mb)
        print(f"wrote {size / 2**20:.0f} MiB of text in {time.perf_counter() - t0:.1f} s", flush=True)
        base = run_job([*MODEL, *run, "--data", "synthetic"], tmp)
        text = run_job([*model, *run, "--data", str(path), "--tokenizer", a.tokenizer], tmp)
    mib = 2**20
    rows = [("launcher", base["launcher"], text["launcher"])]
    rows += [(f"worker {i}", b, t) for i, (b, t) in enumerate(zip(base["workers"], text["workers"]))]
    print(f"\nfile {size / mib:.0f} MiB, tokenizer {a.tokenizer}, dp 2, {a.steps} steps "
          f"(wall {base['s']:.0f} s synthetic, {text['s']:.0f} s text)")
    print("| process | peak RSS, synthetic (MiB) | peak RSS, text (MiB) | growth (MiB) | growth / file |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for name, b, t in rows:
        worst = max(worst, (t - b) / size)
        print(f"| {name} | {b / mib:.0f} | {t / mib:.0f} | {(t - b) / mib:+.1f} | {(t - b) / size:+.3f} |")
    print(f"\nlargest growth of any process: {worst:.3f} of the file")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"size": size, "tokenizer": a.tokenizer,
                                                "synthetic": base, "text": text}, indent=1))


if __name__ == "__main__":
    main()
