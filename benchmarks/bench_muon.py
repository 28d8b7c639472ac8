#!/usr/bin/env python3
"""Muon's step time against AdamW's on the same model and layout, and the balance of the
Newton-Schulz iteration's FLOPs over the ranks that own matrices.

For each layout (ZeRO-1 and ZeRO-3 at dp 2, tp 2) it runs ``trainmesh train`` with
``--optimizer adamw`` and with ``--optimizer muon``, one after the other, on the same model,
data and seed (gloo, one thread per process), and prints the median step time of each (the
steps after the first ``--skip``), Muon's over AdamW's, and Muon's communication per step and
rank beside AdamW's (the owners' all-to-alls over dp and over tp). Then, at
ZeRO-1 and ZeRO-3 (dp 2, one step through the Python API), the iteration's FLOPs each rank ran
as an owner (``MuonAdamW.flops_run``) against their mean: balanced when the largest is within
1.25x.

    python benchmarks/bench_muon.py                                 # the three layouts
    python benchmarks/bench_muon.py --layers 4 --d-model 256 --steps 12
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {"zero1": ["--dp", "2", "--zero", "1"], "zero3": ["--dp", "2", "--zero", "3"],
           "tp2": ["--tp", "2"]}
BALANCE = 1.25
"""The largest rank's iteration FLOPs may be at most this times the mean."""


def run(args: list[str], out: Path) -> tuple[float, dict]:
    """(median step seconds after --skip, rank 0's payload bytes per step by axis and op)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainmesh", "train", *args, "--metrics-out", str(out)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"trainmesh train {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    times = [r["step_time_s"] for r in records if r["event"] == "step"]
    summary = next(r for r in records if r["event"] == "summary")
    return statistics.median(times[ARGS.skip:]), summary["ranks"][0]["comm_bytes_per_step"]


def mib(comm: dict) -> str:
    """Total payload and its ops, in MiB."""
    ops = " ".join(f"{axis}.{op} {b / 2**20:.2f}" for axis, by_op in comm.items()
                   for op, b in by_op.items() if b and axis != "other")
    return f"{sum(b for by_op in comm.values() for b in by_op.values()) / 2**20:.2f} MiB ({ops})"


def _one_step(layers: int, d_model: int, zero: int) -> int:
    """A worker: one Muon step of the GPT at dp 2 and ``zero``; the iteration FLOPs it ran."""
    from trainmesh import Engine, ParallelConfig
    from trainmesh.config.train import TrainConfig
    from trainmesh.data.corpus import SyntheticCorpus
    from trainmesh.data_parallel.muon import MuonAdamW
    from trainmesh.models.gpt import GPT
    from trainmesh.run.optimizers import param_groups
    import torch.distributed as dist
    cfg = TrainConfig(layers=layers, d_model=d_model, optimizer="muon")
    model = GPT(cfg.gpt_config(), seed=0)
    engine = Engine(model, lambda ps: MuonAdamW(ps, lr=0.01), lambda m, b: m(**b),
                    ParallelConfig(dp=2, zero=zero), param_groups=param_groups(cfg, model))
    gpt = cfg.gpt_config()
    batch = SyntheticCorpus(gpt.vocab_size, gpt.seq_len).batch(0, 0, 4)
    rank = dist.get_rank()
    engine.train_step({k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()})
    return engine.optimizer.flops_run


def balance(layers: int, d_model: int, zero: int) -> tuple[list[int], float]:
    """Each rank's measured iteration FLOPs in one step at dp 2, and the largest over the mean."""
    from trainmesh.testing import run_distributed
    got = run_distributed(_one_step, 2, layers, d_model, zero)
    load = [got[r] for r in sorted(got)]
    return load, max(load) / (sum(load) / len(load))


def main() -> None:
    model = ["--layers", str(ARGS.layers), "--d-model", str(ARGS.d_model), "--steps", str(ARGS.steps),
             "--warmup-steps", "2", "--seed", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            (ta, ca), (tm, cm) = (run([*model, *layout, "--optimizer", opt], Path(tmp, f"{name}-{opt}.jsonl"))
                                  for opt in ("adamw", "muon"))
            print(f"{name:6s} adamw {ta * 1e3:7.1f} ms/step  muon {tm * 1e3:7.1f} ms/step  "
                  f"muon/adamw {tm / ta:.2f}x", flush=True)
            print(f"       comm/step rank 0: adamw {mib(ca)}; muon {mib(cm)}", flush=True)
    worst = 0.0
    for zero in (1, 3):
        load, ratio = balance(ARGS.layers, ARGS.d_model, zero)
        flops = ", ".join(f"rank {r} {f / 1e6:.1f} MFLOP" for r, f in enumerate(load))
        verdict = "balanced" if ratio <= BALANCE else "NOT balanced"
        print(f"Newton-Schulz FLOPs per step at dp 2 ZeRO-{zero} (measured): {flops}; "
              f"largest / mean {ratio:.3f} ({verdict}, bound {BALANCE})", flush=True)
        worst = max(worst, ratio)
    if worst > BALANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
    ARGS = parser.parse_args()
    main()
