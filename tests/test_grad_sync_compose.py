"""Data-parallel strategies compose: two instances over disjoint parameter subsets and
different mesh groups live side by side in one backward (dense parameters reduced over ``dp``
by ZeRO-2, "expert" parameters over ``edp`` by ZeRO-1, with small buckets so their collectives
interleave), each giving exactly the mean gradient over its own group, against float64."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tolerances import fp32_atol, scale_of
from torch import nn

from trainmesh import ParallelConfig, ParallelMesh
from trainmesh.comm import Comm
from trainmesh.data_parallel import make_grad_sync

WORLD, EP = 4, 2
ROWS, WIDTH = 6, 16


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _batch(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)


def _reference_grads(ranks: list[int]) -> dict[str, torch.Tensor]:
    """float64: the mean over ``ranks`` of each rank's gradient."""
    model = _model().double()
    for r in ranks:
        model(_batch(r, torch.float64)).pow(2).mean().backward()
    return {n: p.grad / len(ranks) for n, p in model.named_parameters()}


def _two_syncs() -> dict:
    rank = dist.get_rank()
    mesh = ParallelMesh(dp=WORLD, ep=EP)
    comm = Comm(mesh)
    model = _model()
    named = list(model.named_parameters())
    dense = [(n, p) for n, p in named if n.startswith("0.")]
    experts = [(n, p) for n, p in named if n.startswith("2.")]
    syncs = [make_grad_sync(ParallelConfig(dp=WORLD, zero=2, bucket_mb=0.0005), dense, comm, axis="dp"),
             make_grad_sync(ParallelConfig(dp=WORLD, zero=1, bucket_mb=0.0005), experts, comm, axis="edp")]
    before = {n: p.detach().clone() for n, p in named}
    for s in syncs:
        s.build_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0))
        s.before_backward(is_last=True)
    model(_batch(rank)).pow(2).mean().backward()
    for s in syncs:
        s.finish(1.0 / mesh.size(s.axis))
        s.step()
        s.zero_grad()
    got = {n: before[n] - p.detach() for n, p in named}        # SGD lr 1: the gradient
    want = {**{n: g for n, g in _reference_grads(list(range(WORLD))).items() if n.startswith("0.")},
            **{n: g for n, g in _reference_grads(mesh.ranks("edp")).items() if n.startswith("2.")}}
    err = {n: float((got[n].double() - want[n]).abs().max()) for n in want}
    tol = fp32_atol(scale_of(want.values()), ROWS * WIDTH * WORLD) + \
        torch.finfo(torch.float32).eps * scale_of(before.values())
    return {"err": err, "tol": tol, "edp": mesh.ranks("edp"),
            "buckets": [len(s.buckets) for s in syncs]}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_syncs_over_disjoint_parameters_and_groups():
    from trainmesh.testing import run_distributed
    res = run_distributed(_two_syncs, WORLD, timeout_s=100)
    for rank, r in res.items():
        assert r["edp"] == [rank % EP, rank % EP + EP]
        assert min(r["buckets"]) > 1, r["buckets"]      # several buckets each: interleaved launches
        bad = {n: e for n, e in r["err"].items() if e > r["tol"]}
        assert not bad, (rank, bad, r["tol"])
