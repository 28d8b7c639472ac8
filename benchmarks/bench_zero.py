"""trainmesh ZeRO-3 vs FSDP2 ``fully_shard`` and ZeRO-1 vs ``ZeroRedundancyOptimizer`` (world 2).

Each worker holds all four implementations of the same model (same initial weights, data and
processes, one thread per process) and alternates their steps, so machine noise hits them alike;
the ratio of median step times is the figure. Both sides clip the gradient norm at 1.0.
FSDP2 shards the same units trainmesh does (embedding, each block, head, root). Run from the
repository root:

    python benchmarks/bench_zero.py --steps 30
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import BENCH_GPT, GLOBAL_BATCH, interleaved, native_step, report  # noqa: E402

from trainmesh import Engine, ParallelConfig  # noqa: E402
from trainmesh.models.gpt import GPT  # noqa: E402
from trainmesh.testing import run_distributed  # noqa: E402


def fsdp2_step_fn(model: torch.nn.Module, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for unit in (model.embed, *model.blocks, model.head):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return native_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), world, set_to_none=True)


def zero_redundancy_step_fn(model: torch.nn.Module, world: int, bucket_mb: float):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    return native_step(ddp, opt, world)


def worker(steps: int, warmup: int, bucket_mb: float, pairs: list[str]) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = GPT(BENCH_GPT, seed=0)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)   # noqa: E731

    def engine(zero: int) -> Engine:
        return Engine(copy.deepcopy(base), adamw, lambda m, b: m(**b),
                      ParallelConfig(dp=world, zero=zero, grad_clip=1.0, bucket_mb=bucket_mb),
                      broadcast_init=False)

    impls = {}
    if "zero3" in pairs:
        impls["trainmesh ZeRO-3"] = engine(3).train_step
        impls["torch FSDP2"] = fsdp2_step_fn(copy.deepcopy(base), world)
    if "zero1" in pairs:
        impls["trainmesh ZeRO-1"] = engine(1).train_step
        impls["torch ZeroRedundancyOptimizer"] = zero_redundancy_step_fn(copy.deepcopy(base), world, bucket_mb)
    times, losses = interleaved(impls, steps, warmup, rank=rank, world=world)
    if rank:
        return None
    tokens = GLOBAL_BATCH * BENCH_GPT.seq_len
    names = list(impls)
    return "\n\n".join(report(a, times[a], b, times[b], tokens, (losses[a], losses[b]))
                       for a, b in zip(names[::2], names[1::2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--pairs", default="zero3,zero1",
                    help="comma list: zero3 (vs FSDP2), zero1 (vs ZeroRedundancyOptimizer)")
    args = ap.parse_args()
    pairs = [p for p in args.pairs.split(",") if p]
    out = run_distributed(worker, 2, args.steps, args.warmup, args.bucket_mb, pairs, timeout_s=900)
    print(f"model {BENCH_GPT}, params {BENCH_GPT.num_params():,}, global batch {GLOBAL_BATCH}, "
          f"world 2, 1 thread/rank, AdamW, clip 1.0, {args.steps} timed steps")
    print(out[0])


if __name__ == "__main__":
    main()
