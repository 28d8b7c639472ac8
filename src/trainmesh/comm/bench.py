"""nccl-tests-style measurement of every collective through the communication layer.

Bus bandwidth uses nccl-tests' factors, so numbers compare across world sizes: all_reduce
2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n, broadcast 1. ``size`` is the
payload in the ledger's convention (all_gather: the gathered output; reduce_scatter: the input).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..mesh import ParallelMesh
from .ops import Comm

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


@dataclass
class Row:
    op: str
    size_bytes: int
    time_s: float
    algbw: float   # bytes/s
    busbw: float   # bytes/s
    backend: str


def _run_op(comm: Comm, op: str, numel: int, n: int) -> None:
    if op == "all_reduce":
        comm.all_reduce(torch.ones(numel), "dp")
    elif op == "broadcast":
        comm.broadcast(torch.ones(numel), "dp", src=0)
    elif op == "all_gather":
        comm.all_gather(torch.empty(numel), torch.ones(numel // n), "dp")
    elif op == "reduce_scatter":
        comm.reduce_scatter(torch.empty(numel // n), torch.ones(numel), "dp")
    elif op == "all_to_all":
        comm.all_to_all(torch.empty(numel), torch.ones(numel), "dp")


def measure(sizes: list[int], ops: list[str], iters: int, warmup: int = 2) -> list[Row] | None:
    """Run inside every worker; rank 0 returns the rows (times: max over ranks of the mean)."""
    n = dist.get_world_size()
    comm = Comm(ParallelMesh(dp=n))
    rows = []
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4 // n * n)   # fp32 elements, divisible by n
            for _ in range(warmup):
                _run_op(comm, op, numel, n)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                _run_op(comm, op, numel, n)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            t = elapsed.item()
            nbytes = numel * 4
            rows.append(Row(op, nbytes, t, nbytes / t, nbytes / t * bus_factor(op, n), dist.get_backend()))
    return rows if dist.get_rank() == 0 else None
