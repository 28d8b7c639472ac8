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

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from trainmesh import ParallelConfig, ParallelMesh
from trainmesh.comm import Comm
from trainmesh.core.step import StepHooks
from trainmesh.data_parallel import make_grad_sync
from trainmesh.data_parallel.base import SyncOptions
from trainmesh.data_parallel.readiness import reached
from trainmesh.data_parallel.zero3 import Zero3
from trainmesh.data_parallel.zero_pipeline import PipelineZero3
from trainmesh.pipeline_parallel.runtime import PipelineExecutor
from trainmesh.pipeline_parallel.schedules import build_schedule
from trainmesh.pipeline_parallel.stage import ActivationTracker


class Layer(nn.Module):
    """A pipeline layer (a ZeRO-3 unit): ``dense``, then ``expert`` when ``use`` says so; a
    ``shift`` added last, so a split backward's ``W`` runs the layer's output node again."""

    def __init__(self) -> None:
        super().__init__()
        self.dense, self.expert = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
        self.shift = nn.ParameterList([torch.full((4,), 0.1)])   # last: W runs it first
        self.use = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        return (y + self.expert(y) if self.use else y) + self.shift[0]


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
    if pipeline:
        sync: Zero3 = PipelineZero3(named, COMM, module=net, layers=LAYERS, options=UNUSED)
    else:
        sync = Zero3(named, COMM, module=net, options=UNUSED)
    events: list[str] = []
    return _logged(sync, events, ""), events


COMM = Comm(ParallelMesh(local=True))
UNUSED = SyncOptions(find_unused_parameters=True)
LAYERS = ["layers.0", "layers.1"]


def _logged(sync: Zero3, events: list[str], tag: str) -> Zero3:
    """``sync`` with its optimizer, logging into ``events`` each gather that moves a unit and
    each reduction (``tag``: which strategy)."""
    sync.build_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
    gather, reduce = sync.residency.gather, sync._reduce_unit

    def logged_gather(unit, **how):
        if unit.state.name == "FREE":
            events.append(f"gather {tag}{unit.name}")
        gather(unit, **how)

    def logged_reduce(unit, *, final):
        events.append(f"reduce {tag}{unit.name}")
        reduce(unit, final=final)
    sync.residency.gather, sync._reduce_unit = logged_gather, logged_reduce
    return sync


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


# ---------------------------------------------------------------- under zb1p's split backward
# Its I computes the input gradient and its W, later, the weight gradients, with another
# microbatch's I possibly in between (the last stage of pp 2 runs F0 I0 F1 I1 W0 F2 I2 W1 W2).
# A unit's reduction round is a W: the walk is made there (the runtime), what a microbatch does
# not reach passes there, and the units of the dense and the experts' strategies go out in one
# order whatever completes first, so a unit no row reached on this rank goes out where its
# peer's, reached, does. The real runtime runs the real zb1p schedule of one stage here, with
# the strategies make_grad_sync builds; the stage's pipeline neighbours are a stand-in.
#
# Planted, each failing with "AssertionError: zb1p: [rank A's events] != [rank B's]": the walk
# at I (as before) with A reducing its idle layer-1 experts inside I0 ('1I0', 'reduce experts
# layers.1', '1F1', ...); the units launched as each completes (A's W1: 'reduce experts
# layers.0', 'reduce experts layers.1' against B's layer 1 first); the dense and the experts'
# strategies each in its own order; the schedule's split not passed to ZeRO-3; a unit open at
# the walk not passed there; W running a passed unit's output node gathering it again (A's W2:
# 'reduce experts layers.1', 'gather experts layers.1').

M = 3


class _Neighbours:
    """The stage's pipeline neighbours: microbatch i's input and its output's gradient."""

    def begin(self, key) -> None:
        pass

    def finish(self) -> None:
        pass

    def take(self, key) -> torch.Tensor:
        kind, _, i = key
        return _x(10 + i) if kind == "act" else torch.randn(3, 4, generator=torch.Generator().manual_seed(20 + i))

    def send(self, key, tensor) -> None:
        pass


class _LossIO:
    def input_of(self, i: int) -> torch.Tensor:
        return _x(10 + i)

    def loss(self, out: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return out.pow(2).sum(), torch.tensor(1.0)


def _zb1p_stage(net: Net, rank: int, used: dict[int, list[bool]], events: list[str]):
    """The real :class:`PipelineExecutor` on stage ``rank`` of zb1p at pp 2 (2 layers, M
    microbatches); ``used[j][i]``: layer j's expert runs on microbatch i."""
    schedule = build_schedule("zb1p", 2, M)
    ex = PipelineExecutor.__new__(PipelineExecutor)

    def chunk(x: torch.Tensor, i: int) -> torch.Tensor:
        for j, layer in enumerate(net.layers):
            layer.use = used[j][i]
            x = layer(x)
        return x
    ex.schedule, ex.rank, ex.peers, ex.comm = schedule, rank, [0, 1], None
    ex.chunks, ex.io, ex.p2p = {rank: chunk}, _LossIO(), _Neighbours()
    ex.tracker, ex.track_memory, ex._ties, ex.tied_parameters = ActivationTracker(), False, [], []
    ex._kept, ex._weights = {}, {}
    ex._chunk_params = {rank: list(net.parameters())}
    act = ex._act

    def logged_act(action, microbatches, hooks):
        events.append(action.label())
        return act(action, microbatches, hooks)
    ex._act = logged_act
    return ex


def _zb1p_syncs(net: Net, experts_alone: bool, reshard: str):
    """ZeRO-3 under zb1p as the run builds it (make_grad_sync): with ep, a strategy for the
    dense parameters and one for the experts (each unit a layer's experts), reducing in one
    order; without, one strategy over every parameter (each unit a whole layer). One log."""
    cfg = ParallelConfig(pp=2, microbatches=M, zero=3, zero3_reshard=reshard, schedule="zb1p",
                         find_unused_parameters=True)
    kind = (lambda n: "expert" if ".expert." in n else "dense") if experts_alone else None
    sync = make_grad_sync(cfg, list(net.named_parameters()), COMM, module=net, layers=LAYERS,
                          kind_of=kind)
    events: list[str] = []
    parts = sync.parts if experts_alone else [sync]
    for part, tag in zip(parts, ("dense ", "experts ") if experts_alone else ("",)):
        _logged(part, events, tag)
    return sync, events


def _zb1p_run(rank: int, used: dict[int, list[bool]], experts_alone: bool, reshard: str):
    """One step of the stage under ZeRO-3 (:func:`_zb1p_syncs`): its events, (loss, count),
    the layers' expert gradients."""
    net = Net()
    sync, events = _zb1p_syncs(net, experts_alone, reshard)
    ex = _zb1p_stage(net, rank, used, events)
    hooks = StepHooks(autocast=nullcontext, scale_loss=lambda t: t, before_backward=None,
                      expect_backwards=sync.expect_backwards,
                      backward_from=lambda root, params: sync.pass_unreached(
                          reached([root]), {id(p) for p in params}))
    loss = ex.run(list(range(M)), hooks)
    sync.finish(1.0)
    names = [f"layers.{j}.expert.weight" for j in range(2)]
    return events, loss, [g.clone() for g in sync.grads_of(names)]


def _reference(rank: int, used: dict[int, list[bool]]):
    """One process, plain autograd: the stage's loss and its experts' gradients."""
    net, loss = Net(), 0.0
    io, nb = _LossIO(), _Neighbours()
    for i in range(M):
        x = io.input_of(i) if rank == 0 else nb.take(("act", 1, i))
        for j, layer in enumerate(net.layers):
            layer.use = used[j][i]
            x = layer(x)
        if rank == 1:
            out = x.pow(2).sum()
            loss += float(out.detach())
            out.backward()
        else:
            x.backward(nb.take(("grad", 0, i)))
    return loss, [net.layers[j].expert.weight.grad.reshape(-1) for j in range(2)]


@pytest.mark.parametrize("reshard", ["step", "microbatch"])
@pytest.mark.parametrize("experts_alone", [True, False], ids=["ep-unit", "in-block"])
@pytest.mark.parametrize("rank", [0, 1], ids=["first-stage", "last-stage"])
def test_zb1p_reduces_a_unit_one_rank_does_not_reach_where_its_peer_does(rank, experts_alone,
                                                                          reshard):
    """Rank A's layer 1 expert sits out microbatches 0 and 2, its layer 0 expert microbatch 1;
    rank B uses both everywhere. Both issue the same gathers and reductions in the same
    order, each inside the same W; A's loss and expert gradients are one process's."""
    used = {"A": {0: [True, False, True], 1: [False, True, False]},
            "B": {0: [True] * M, 1: [True] * M}}
    runs = {peer: _zb1p_run(rank, used[peer], experts_alone, reshard) for peer in ("A", "B")}
    assert runs["A"][0] == runs["B"][0], f"zb1p: {runs['A'][0]} != {runs['B'][0]}"
    tag = "experts " if experts_alone else ""
    for j in range(2):
        assert runs["A"][0].count(f"reduce {tag}layers.{j}") == M, runs["A"][0]
    # exactly: the same ops in the same order (W computes each weight gradient as a plain
    # backward does; a one-rank reduce-scatter is a copy)
    for peer in ("A", "B"):
        loss, grads = _reference(rank, used[peer])
        if rank == 1:
            assert runs[peer][1] == (loss, M)
        for j in range(2):
            got = runs[peer][2][j].reshape(-1)[: grads[j].numel()]
            assert torch.equal(got, grads[j]), (peer, j, got, grads[j])
