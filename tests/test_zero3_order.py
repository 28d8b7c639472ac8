"""ZeRO-3 issues its collectives in the same order on every DP rank, whatever lands first.

Collectives on a group pair by their position in each rank's sequence, so a gather that one
rank issues before a reduce-scatter and its peer after it pairs a gather with a reduce-scatter
(gloo aborts the processes). ZeRO-3 prefetches the next unit of backward while a unit's
gradients come in; whether the previous unit's reduce-scatter has landed differs between ranks
when one is late, so that must not decide when the prefetch is issued. Here one rank is made
late inside each block's backward, one never sees a collective land before it waits for it and
the other sees each land at once; each rank's sequence of dp collectives (the ledger's spans,
in issue order) must be the same, and the weights equal a one-process run's.
"""
from __future__ import annotations

import time

import pytest
import torch
from test_any_model import SometimesModule
from torch import nn

from trainmesh.testing import run_distributed

STEPS = 3


class _Late(torch.autograd.Function):
    """Identity; its backward sleeps on DP rank 1: inside each block's backward, between its
    layers' gradients, so that rank's reduce-scatters issue late."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            time.sleep(0.05)
        return g


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(_Late.apply(torch.tanh(self.a(x))))   # late between b's and a's gradients


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class MiddleSometimes(SometimesModule):
    """``extra`` runs between the layers, only when the input asks for it."""

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if bool(flag.any()):
            x = self.extra(x)
        return self.layers[1](x).pow(2).mean()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(STEPS)]


def _reference() -> dict[str, torch.Tensor]:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        opt.zero_grad()
        model(x).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run() -> dict:
    import trainmesh as tm
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    # rank 0 never sees a collective land before it waits for it; rank 1 sees each land at once
    from trainmesh.comm.ops import Handle
    Handle.is_completed = (lambda self: self.done or self._work is None) if rank == 0 else (lambda self: True)
    engine = tm.Engine(Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), lambda m, b: m(b),
                       tm.ParallelConfig(dp=2, zero=3, timeout_s=60))
    engine.comm.ledger.tracing = True
    for x in _batches():
        engine.train_step(x[rank * 4 : (rank + 1) * 4])
    order = [(s.op, s.nbytes) for s in engine.comm.ledger.spans if s.axis == "dp"]
    out = {"order": order, "weights": engine.full_state_dict()}
    # a module run on one rank only, where its peer has the next unit prefetched: named
    engine = tm.Engine(MiddleSometimes(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                       lambda m, b: m(*b), tm.ParallelConfig(dp=2, zero=3, find_unused_parameters=True, timeout_s=30))
    x = torch.randn(4, 8)
    engine.train_step((x, torch.full((4,), False)))
    try:
        engine.train_step((x, torch.full((4,), rank == 0)))
        out["raised"] = None
    except RuntimeError as exc:
        out["raised"] = str(exc)
    return out


@pytest.fixture(scope="module")
def res() -> dict:
    """One launch for both tests (the processes dying is a failed assertion, not an error)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        return run_distributed(_run, 2, timeout_s=120)
    except ChildFailedError as exc:
        return {"died": str(exc)}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_late_rank_issues_the_same_collectives_in_the_same_order(res):
    """Bug: the backward prefetch issued when the previous reduce-scatter has landed (varies by
    rank): a late rank's gather and its peer's reduce-scatter pair up, and gloo aborts."""
    assert "died" not in res, f"the processes died (mismatched collectives): {res.get('died')}"
    assert res[0]["order"] == res[1]["order"], "the DP ranks issued their collectives in different orders"
    assert any(op == "reduce_scatter" for op, _ in res[0]["order"]), res[0]["order"]
    want = _reference()
    for rank in (0, 1):
        got = res[rank]["weights"]
        # SGD on 16 x 16 layers, 3 steps, the mean of two half-batch gradients: a few float32
        # roundings per element of weights ~0.25
        err = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert err <= 1e-5, f"rank {rank}: weights differ from one process by {err}"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_module_run_on_one_rank_is_named_where_its_peer_prefetched(res):
    """Bug: the peer's forward ends (its next unit prefetched) while this rank gathers a module
    it alone runs: rows of two sizes pair up and gloo aborts, or the rank waits forever."""
    assert "died" not in res, f"the processes died instead of naming the module: {res.get('died')}"
    for rank in (0, 1):
        msg = res[rank]["raised"]
        assert msg is not None and "different units" in msg and "'extra'" in msg, msg
