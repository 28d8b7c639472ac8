"""trainmesh HSDP (``--dp-shard 2``) vs torch FSDP2's HSDP, and vs plain ZeRO-3 (world 4).

Each worker holds three implementations of the same model (same initial weights, data and
processes, one thread per process) and alternates their steps, so machine noise hits them alike:
trainmesh ZeRO-3 sharded over shard groups of 2 and replicated across 2 (HSDP), torch FSDP2
``fully_shard`` on a (replicate 2, shard 2) device mesh, and trainmesh ZeRO-3 over all 4 ranks.
Both sides clip the gradient norm at 1.0. The ratio of median step times is the figure; the
per-axis traffic of trainmesh's two layouts is printed from its communication ledger. Run from
the repository root:

    python benchmarks/bench_hsdp.py --steps 20
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import BENCH_GPT, GLOBAL_BATCH, interleaved, native_step, report  # noqa: E402

from trainmesh import Engine, ParallelConfig  # noqa: E402
from trainmesh.models.gpt import GPT  # noqa: E402
from trainmesh.testing import run_distributed  # noqa: E402

WORLD, SHARD = 4, 2


def fsdp2_hsdp_step_fn(model: torch.nn.Module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD // SHARD, SHARD), mesh_dim_names=("replicate", "shard"))
    for unit in (model.embed, *model.blocks, model.head):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return native_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), WORLD, set_to_none=True)


def worker(steps: int, warmup: int) -> str | None:
    rank = dist.get_rank()
    base = GPT(BENCH_GPT, seed=0)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)   # noqa: E731
    engines = {f"trainmesh ZeRO-3 HSDP (dp {WORLD}, dp-shard {SHARD})":
               Engine(copy.deepcopy(base), adamw, lambda m, b: m(**b),
                      ParallelConfig(dp=WORLD, zero=3, dp_shard=SHARD, grad_clip=1.0), broadcast_init=False),
               f"trainmesh ZeRO-3 (dp {WORLD})":
               Engine(copy.deepcopy(base), adamw, lambda m, b: m(**b),
                      ParallelConfig(dp=WORLD, zero=3, grad_clip=1.0), broadcast_init=False)}
    names = list(engines)
    impls = {names[0]: engines[names[0]].train_step,
             "torch FSDP2 HSDP (replicate 2 x shard 2)": fsdp2_hsdp_step_fn(copy.deepcopy(base)),
             names[1]: engines[names[1]].train_step}
    times, losses = interleaved(impls, steps, warmup, rank=rank, world=WORLD)
    traffic = {n: e.comm_bytes_per_step() for n, e in engines.items()}
    if rank:
        return None
    tokens = GLOBAL_BATCH * BENCH_GPT.seq_len
    keys = list(impls)
    lines = [report(keys[0], times[keys[0]], keys[1], times[keys[1]], tokens, (losses[keys[0]], losses[keys[1]])),
             f"\n{keys[2]}: median step {statistics.median(times[keys[2]]):.4f} s; "
             f"max |loss difference| vs HSDP {max(abs(a - b) for a, b in zip(losses[keys[0]], losses[keys[2]])):.2e}",
             "\nrank 0 payload bytes per step (comm_bytes_per_step):"]
    for name, axes in traffic.items():
        shown = {a: {op: int(b) for op, b in ops.items()} for a, ops in axes.items() if ops}
        lines.append(f"- {name}: {shown}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    out = run_distributed(worker, WORLD, args.steps, args.warmup, timeout_s=900)
    print(f"model {BENCH_GPT}, params {BENCH_GPT.num_params():,}, global batch {GLOBAL_BATCH}, "
          f"world {WORLD}, 1 thread/rank, AdamW, clip 1.0, {args.steps} timed steps")
    print(out[0])


if __name__ == "__main__":
    main()
