"""trainmesh with ``--compile`` vs without, same model, data and processes (CPU, inductor).

Each worker holds both engines and alternates their steps, so machine noise hits both alike;
the ratio of median step times is the figure. The first steps compile (excluded as warm-up).
Run from the repository root:

    python benchmarks/bench_compile.py --steps 20
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import BENCH_GPT, GLOBAL_BATCH, batches, report, timed  # noqa: E402

from trainmesh import Engine, ParallelConfig  # noqa: E402
from trainmesh.data.corpus import dp_slice  # noqa: E402
from trainmesh.models.gpt import GPT  # noqa: E402
from trainmesh.testing import run_distributed  # noqa: E402


def worker(steps: int, warmup: int) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)   # noqa: E731
    engines = {c: Engine(GPT(BENCH_GPT, seed=0), adamw, lambda m, b: m(**b),
                         ParallelConfig(dp=world, grad_clip=1.0, compile=c), broadcast_init=False)
               for c in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {False: [], True: []}
    t0 = time.perf_counter()
    for k, batch in enumerate(batches(steps + warmup)):
        mine = dp_slice(batch, rank, world)
        for c, engine in engines.items():
            t, loss = timed(lambda: engine.train_step(mine))
            if k >= warmup:
                times[c].append(t)
            losses[c].append(loss)
        if k == 0 and rank == 0:
            print(f"first step (compiles): {time.perf_counter() - t0:.1f} s", flush=True)
    if rank:
        return None
    tokens = GLOBAL_BATCH * BENCH_GPT.seq_len
    return report("compiled", times[True], "eager", times[False], tokens,
                  (losses[True], losses[False]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--world", type=int, default=1, help="DP ranks (one thread each)")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    args = ap.parse_args()
    out = run_distributed(worker, args.world, args.steps, args.warmup, timeout_s=900,
                          threads=args.threads)
    print(f"model {BENCH_GPT}, params {BENCH_GPT.num_params():,}, global batch {GLOBAL_BATCH}, "
          f"world {args.world}, {args.threads} thread(s)/rank, {args.steps} timed steps, "
          f"torch {torch.__version__}")
    print(out[0])


if __name__ == "__main__":
    main()
