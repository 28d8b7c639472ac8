"""ZeRO-3 units that a backward pass does not reach on one rank but does on another: every rank
gathers and reduces them at the same places of the group's sequence (docs/ZERO.md).

Under expert parallelism the experts are their own strategy over ``edp``, whose ZeRO-3 units
hold only a layer's experts; a rank whose microbatch routed no row to its experts of a layer
does not reach that unit at all, while a peer of its ``edp`` group, with other tokens, does.
The unit must then pass on the first rank where the second is inside that unit's backward:
before, it was reduced at the end of the backward (no pipeline: another unit's reduction
paired with it) or, under a pipeline, not in that pass at all (one reduction fewer: the
16-process MoE mesh hung at step 9 of its data, a rank alone in a reduce_scatter over edp).

In one process (``ParallelMesh(local=True)``): two layers, each a dense part always used and
an "expert" used when asked, the experts under their own ZeRO-3 strategy as ep gives them. A
pass where layer 1's expert sits out (rank A's routing) and one where it runs (rank B's) must
issue the same gathers and reductions in the same order, in one backward and in a pipeline's
two microbatches; the pipeline's gradient is the sum over the microbatches that used it.

Planted (the previous rule: a unit no parameter of which the pass reaches is not passed in
that pass) fails with "AssertionError: no pipeline: [..., 'reduce layers.0', 'reduce layers.1']
!= [..., 'reduce layers.1', 'reduce layers.0']" and "AssertionError: pipeline: ['gather
layers.0', 'gather layers.1', 'reduce layers.0', 'pass 0 done', ...] != ['gather layers.0',
'gather layers.1', 'reduce layers.1', 'reduce layers.0', 'pass 0 done', ...]" (rank A's
reduction of layer 1 missing from pass 0, made at the step's end instead).
"""
from __future__ import annotations

import torch
from torch import nn

from trainmesh import ParallelMesh
from trainmesh.comm import Comm
from trainmesh.data_parallel.base import SyncOptions
from trainmesh.data_parallel.readiness import reached
from trainmesh.data_parallel.zero3 import Zero3
from trainmesh.data_parallel.zero_pipeline import PipelineZero3


class Layer(nn.Module):
    """A pipeline layer (a ZeRO-3 unit): ``dense``, then ``expert`` when ``use`` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.expert = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        return y + self.expert(y) if self.use else y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).sum()


def _experts(net: Net, pipeline: bool) -> tuple[Zero3, list[str]]:
    """The experts' strategy (find_unused_parameters, as MoE runs it) and its event log: each
    gather that moves a unit and each reduction, by unit."""
    named = [(n, p) for n, p in net.named_parameters() if ".expert." in n]
    comm = Comm(ParallelMesh(local=True))
    options = SyncOptions(find_unused_parameters=True)
    if pipeline:
        sync: Zero3 = PipelineZero3(named, comm, module=net, layers=["layers.0", "layers.1"],
                                    options=options)
    else:
        sync = Zero3(named, comm, module=net, options=options)
    sync.build_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    events: list[str] = []
    gather, reduce = sync.residency.gather, sync._reduce_unit

    def logged_gather(unit, *, wait):
        if unit.state.name == "FREE":
            events.append(f"gather {unit.name}")
        gather(unit, wait=wait)

    def logged_reduce(unit, *, final):
        events.append(f"reduce {unit.name}")
        reduce(unit, final=final)
    sync.residency.gather, sync._reduce_unit = logged_gather, logged_reduce
    return sync, events


def _x(k: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(k))


def _backward(net: Net, sync: Zero3, k: int, layer1_expert: bool) -> None:
    net.layers[1].use = layer1_expert
    loss = net(_x(k))
    sync.pass_unreached(reached([loss]))     # the engine's walk before each backward
    loss.backward()


def test_a_unit_one_rank_does_not_reach_is_reduced_where_its_peer_reduces_it():
    """No pipeline: one backward; layer 1's expert unit reduced before layer 0's on both."""
    runs = {}
    for rank, used in (("A", False), ("B", True)):
        net = Net()
        sync, events = _experts(net, pipeline=False)
        sync.before_backward(is_last=True)
        _backward(net, sync, 0, used)
        sync.finish(1.0)
        runs[rank] = events
    assert runs["A"] == runs["B"], f"no pipeline: {runs['A']} != {runs['B']}"
    assert runs["B"].index("reduce layers.1") < runs["B"].index("reduce layers.0")


def test_a_pipeline_reduces_an_unreached_unit_in_every_pass():
    """Pipeline, 2 microbatches: rank A's layer 1 expert sits out microbatch 0 only. Each unit
    is reduced once per pass on both ranks, in the same order; A's gradient is microbatch 1's."""
    runs, grads = {}, {}
    for rank, used in (("A", [False, True]), ("B", [True, True])):
        net = Net()
        sync, events = _experts(net, pipeline=True)
        sync.expect_backwards(2)
        for k in range(2):
            _backward(net, sync, k, used[k])
            events.append(f"pass {k} done")
        sync.finish(1.0)
        runs[rank] = events
        grads[rank] = [g.clone() for g in sync.grads_of(["layers.1.expert.weight"])]
    assert runs["A"] == runs["B"], f"pipeline: {runs['A']} != {runs['B']}"
    assert runs["A"].count("reduce layers.1") == 2, runs["A"]
    net = Net()                                  # the reference: microbatch 1's gradient
    net(_x(1)).backward()
    want = net.layers[1].expert.weight.grad.reshape(-1)
    assert torch.allclose(grads["A"][0].reshape(-1)[: want.numel()], want), "layer 1 expert grad"
