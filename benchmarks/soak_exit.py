"""Soak of clean exits: N consecutive torchrun launches (dp 2) of a script that trains through
the Python API and ends normally, without calling ``tm.shutdown()``.

Every launch must exit 0. Before ``init_distributed`` shut the process group down at exit, about
one launch in 8-15 aborted after the run had finished ("terminate called without an active
exception", SIGABRT): gloo's worker threads still held the last collectives' work, whose tensors
were freed after the interpreter had gone. ``--plant-no-shutdown`` removes that exit handler, to
see the failure come back. Prints one line per failed launch and a summary; exits 1 when any
launch failed.

    PYTHONPATH=src python benchmarks/soak_exit.py --launches 50
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import atexit, sys
import torch
import trainmesh as tm
from trainmesh.core.distributed import shutdown_at_exit
torch.set_num_threads(1)
tm.init_distributed(device="cpu")
if "--plant-no-shutdown" in sys.argv:
    atexit.unregister(shutdown_at_exit)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
engine = tm.Engine(model, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                   loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]),
                   config=tm.ParallelConfig(dp=2))
g = torch.Generator().manual_seed(1)
for step in range(20):
    engine.train_step({"x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 1, generator=g)})
t = torch.ones(256)
torch.distributed.all_reduce(t, async_op=True).wait()   # the user's own last collective
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--plant-no-shutdown", action="store_true",
                    help="remove init_distributed's exit handler (the failure this soak guards)")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    failed = 0
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train_api.py"
        script.write_text(SCRIPT)
        for i in range(1, args.launches + 1):
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2", str(script),
                                  *(["--plant-no-shutdown"] if args.plant_no_shutdown else [])],
                                 capture_output=True, text=True, env=env, timeout=300)
            if run.returncode != 0:
                failed += 1
                why = "SIGABRT" if "exitcode  : -6" in run.stderr else f"exit {run.returncode}"
                aborted = "terminate called" in run.stderr
                print(f"launch {i}: {why}{' (terminate called without an active exception)' if aborted else ''}",
                      flush=True)
    print(f"{args.launches - failed}/{args.launches} launches exited 0 "
          f"({time.perf_counter() - began:.0f} s{', exit handler removed' if args.plant_no_shutdown else ''})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
