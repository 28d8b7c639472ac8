"""nccl-tests-style measurement of every collective through the communication layer.

Bus bandwidth uses nccl-tests' factors, so numbers compare across world sizes: all_reduce
2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n, broadcast 1. ``size`` is the
payload in the ledger's convention (all_gather: the gathered output; reduce_scatter: the input).

all_reduce is also timed with the hand-built algorithms of :mod:`.algorithms` (``ring``,
``tree``, ``naive``) beside the backend's (``native``): each row then says how many bytes the
busiest rank really sent (from the ledger), what theory says it should, and how far the result
is from the backend's on the same random input.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh

from .algorithms import all_reduce, theory_sent_bytes
from .ops import Comm

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


@dataclass
class Row:
    op: str
    algorithm: str
    size_bytes: int
    time_s: float
    algbw: float   # bytes/s
    busbw: float   # bytes/s
    sent_bytes_max_rank: int | None       # measured by the ledger (hand-built algorithms)
    sent_bytes_theory: float | None       # algorithms.theory_sent_bytes
    max_abs_diff_vs_native: float | None  # result vs the backend's all_reduce, max over ranks
    backend: str


def _run_op(comm: Comm, op: str, numel: int, n: int, algorithm: str = "native",
            buf: torch.Tensor | None = None) -> None:
    if op == "all_reduce":
        all_reduce(comm, buf if buf is not None else torch.zeros(numel), Group.dp, algorithm=algorithm)
    elif op == "broadcast":
        comm.broadcast(torch.ones(numel), Group.dp, src=0)
    elif op == "all_gather":
        comm.all_gather(torch.empty(numel), torch.ones(numel // n), Group.dp)
    elif op == "reduce_scatter":
        comm.reduce_scatter(torch.empty(numel // n), torch.ones(numel), Group.dp)
    elif op == "all_to_all":
        comm.all_to_all(torch.empty(numel), torch.ones(numel), Group.dp)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time(comm: Comm, op: str, numel: int, n: int, algorithm: str, iters: int, warmup: int) -> float:
    """Mean seconds per call, the slowest rank's."""
    buf = torch.zeros(numel) if op == "all_reduce" else None
    for _ in range(warmup):
        _run_op(comm, op, numel, n, algorithm, buf)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        _run_op(comm, op, numel, n, algorithm, buf)
    return _max_over_ranks((time.perf_counter() - t0) / iters)


def _check(comm: Comm, numel: int, algorithm: str, reference: torch.Tensor,
           x: torch.Tensor) -> tuple[int, float]:
    """(bytes the busiest rank sent in one call, max |result - native| over ranks)."""
    t = x.clone()
    comm.ledger.begin_step()
    all_reduce(comm, t, Group.dp, algorithm=algorithm)
    window = comm.ledger.end_step()
    sent = window["dp"]["send"].bytes if "send" in window.get("dp", {}) else 0
    return int(_max_over_ranks(sent)), _max_over_ranks((t - reference).abs().max().item())


def _all_reduce_rows(comm: Comm, size: int, algorithms: list[str], iters: int,
                     warmup: int) -> list[Row]:
    n = dist.get_world_size()
    numel = max(n, size // 4)    # fp32 elements (need not divide by n)
    nbytes = numel * 4
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + numel)
    x = torch.randn(numel, generator=gen)
    reference = x.clone()
    comm.all_reduce(reference, Group.dp)
    rows = []
    for algorithm in algorithms:
        t = _time(comm, "all_reduce", numel, n, algorithm, iters, warmup)
        sent, diff = _check(comm, numel, algorithm, reference, x)
        native = algorithm == "native"
        rows.append(Row("all_reduce", algorithm, nbytes, t, nbytes / t, nbytes / t * bus_factor("all_reduce", n),
                        None if native else sent,
                        None if native else theory_sent_bytes(algorithm, nbytes, n),
                        diff, dist.get_backend()))
    return rows


def measure(sizes: list[int], ops: list[str], iters: int, algorithms: list[str] | None = None,
            warmup: int = 2) -> list[Row] | None:
    """Run inside every worker; rank 0 returns the rows (times: max over ranks of the mean)."""
    n = dist.get_world_size()
    comm = Comm(ParallelMesh(dp=n))
    algorithms = algorithms or ["native"]
    rows = []
    for op in ops:
        for size in sizes:
            if op == "all_reduce":
                rows += _all_reduce_rows(comm, size, algorithms, iters, warmup)
                continue
            numel = max(n, size // 4 // n * n)   # fp32 elements, divisible by n
            t = _time(comm, op, numel, n, "native", iters, warmup)
            nbytes = numel * 4
            rows.append(Row(op, "native", nbytes, t, nbytes / t, nbytes / t * bus_factor(op, n),
                            None, None, None, dist.get_backend()))
    return rows if dist.get_rank() == 0 else None
