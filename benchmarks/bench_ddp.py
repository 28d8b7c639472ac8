"""trainmesh DDP vs torch DistributedDataParallel, same model, data and processes (world 2).

Each worker holds both implementations and alternates their steps, so machine noise hits both
alike; the ratio of median step times is the figure. Run from the repository root:

    python benchmarks/bench_ddp.py --steps 30
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import BENCH_GPT, GLOBAL_BATCH, batches, native_step, report, timed  # noqa: E402

from trainmesh import Engine, ParallelConfig  # noqa: E402
from trainmesh.data.corpus import dp_slice  # noqa: E402
from trainmesh.models.gpt import GPT  # noqa: E402
from trainmesh.testing import run_distributed  # noqa: E402


def worker(steps: int, warmup: int, bucket_mb: float) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(BENCH_GPT, seed=0)
    twin = copy.deepcopy(model)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)   # noqa: E731
    ours = Engine(model, adamw, lambda m, b: m(**b),
                  ParallelConfig(dp=world, grad_clip=1.0, bucket_mb=bucket_mb), broadcast_init=False)
    ddp = torch.nn.parallel.DistributedDataParallel(twin, bucket_cap_mb=bucket_mb)
    opt = adamw(ddp.parameters())

    torch_step = native_step(ddp, opt, world)

    t_ours, t_torch, l_ours, l_torch = [], [], [], []
    for k, batch in enumerate(batches(steps + warmup)):
        mine = dp_slice(batch, rank, world)
        a, la = timed(lambda: ours.train_step(mine))
        b, lb = timed(lambda: torch_step(mine))
        if k >= warmup:
            t_ours.append(a); t_torch.append(b)
        l_ours.append(la); l_torch.append(lb)
    if rank:
        return None
    tokens = GLOBAL_BATCH * BENCH_GPT.seq_len
    return report("trainmesh DDP", t_ours, "torch DDP", t_torch, tokens, (l_ours, l_torch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args()
    out = run_distributed(worker, 2, args.steps, args.warmup, args.bucket_mb, timeout_s=600)
    print(f"model {BENCH_GPT}, params {BENCH_GPT.num_params():,}, global batch {GLOBAL_BATCH}, "
          f"world 2, 1 thread/rank, {args.steps} timed steps")
    print(out[0])


if __name__ == "__main__":
    main()
