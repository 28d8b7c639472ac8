"""The pipeline runtime: one generic runner that executes this rank's action list.

The engine builds a :class:`PipelineExecutor` when ``pp > 1`` (from the model, its ``loss_fn``
and a :class:`~.schedules.Schedule`) and calls :meth:`run` once per step with the DP replica's
microbatches and the step's hooks; it implements :class:`trainmesh.core.step.Executor`, as the
local executor does. The executor keeps only this rank's stages (``module``) and, for each
action of this rank, in order:

* ``F(s, i)``: take the input (microbatch ``i``'s inputs on stage 0, else the activation received
  from stage ``s-1``), run the stage's layers, keep input and output for the backward, send the
  output to stage ``s+1``; the last stage computes the loss instead, with the engine's
  ``loss_fn`` (:class:`.stage.StageIO`).
* ``B(s, i)``: backward from the loss (last stage, scaled by ``hooks.scale_loss``) or from the
  output gradient received from stage ``s+1``; send the input gradient to stage ``s-1``; free
  the microbatch's activations.
* ``I(s, i)`` / ``W(s, i)`` (zero-bubble schedules): ``B`` split in two (:mod:`.split_backward`):
  ``I`` computes and sends the input gradient only, ``W`` later accumulates the weight
  gradients (the DP strategy's hooks fire then) and frees the activations. The parameters
  the microbatch does not reach are told to the strategy (``hooks.backward_from``) at ``W``, with
  its gradients, not at ``I`` (another microbatch's ``W`` may come in between).

:meth:`evaluate` runs the forward-only schedule (:func:`.schedules.forward_only`: the same
``F`` actions, no backward) without gradients, over its own message plan.

Sends and receives come from :mod:`.p2p` (deadlock-free for any schedule that simulates). The
runtime knows nothing of data parallelism: it tells the step's hooks once that every parameter
sees ``m`` backward passes (``hooks.expect_backwards``), and the engine's strategy reduces each
gradient after its last; a weight tied across stages is summed over its stages first, then
released to the strategy (``hooks.release``). Every action's start and end (``perf_counter``) go into
``last_timeline`` (this rank's row); :func:`.timeline.gather_timeline` assembles the pipeline's.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainmesh.core.axes import Facts
from trainmesh.core.errors import ConfigError
from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.step import LossFn, StepHooks
from trainmesh.strategies import table

from ..comm import Comm
from .hf import pipeline_model
from .p2p import StageP2P
from .partition import named_pipeline_layers, partition, shared_stages, ties_on_one_rank
from .schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    FORWARD,
    Action,
    Schedule,
    TimedAction,
    Timeline,
    forward_only,
)
from .split_backward import (
    SPLIT_BACKWARD_SUPPORTED,
    PendingWeights,
    backward_input,
    backward_weight,
)
from .stage import ActivationTracker, Chunk, LocalModule, StageIO, release_layers


def batch_key(batch: Any) -> tuple:
    """Shapes and dtypes of a microbatch's tensors: equal keys need no new shape headers."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, dict):
        return tuple((k, batch_key(v)) for k, v in sorted(batch.items(), key=lambda kv: str(kv[0])))
    if isinstance(batch, (tuple, list)):
        return tuple(batch_key(v) for v in batch)
    return (type(batch).__name__,)


class PipelineExecutor:
    """Runs this rank's share of a pipeline schedule (a :class:`trainmesh.core.step.Executor`).

    ``cuts`` (optional, also read from ``model.pipeline_cuts``) are explicit stage boundaries:
    the first layer index of each stage after the first. ``loss_fn(model, microbatch)`` is the
    engine's, run on the last stage (see :mod:`.stage` for the bring-your-own-model protocol).
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], loss_fn: LossFn,
                 mesh: ParallelMesh, comm: Comm, schedule: Schedule, *,
                 cuts: Sequence[int] | None = None, device: torch.device | None = None) -> None:
        if schedule.splits_backward and not SPLIT_BACKWARD_SUPPORTED:
            raise ConfigError("schedule", f"{schedule.name} splits the backward into I and W, which "
                                          f"needs torch >= 2.7 (this is {torch.__version__}); "
                                          "valid here: naive, gpipe, 1f1b, interleaved")
        self.mesh, self.comm, self.schedule = mesh, comm, schedule
        self.rank, self.peers = mesh.index(Group.pp), mesh.ranks(Group.pp)
        model = pipeline_model(model)          # a Hugging Face model: cut from its plan
        stages = partition(named_pipeline_layers(model), schedule.num_stages,
                           cuts if cuts is not None else getattr(model, "pipeline_cuts", None))
        self.stage_layers = [[name for name, _ in st] for st in stages]
        mine = schedule.stages_of_rank(self.rank)
        run = getattr(model, "pipeline_forward", None)
        self.chunks = {s: Chunk(s, stages[s], run) for s in mine}
        held = [nl for s in mine for nl in stages[s]]
        self.layer_names = [name for name, _ in held]
        """This rank's pipeline layers (each called on its own: ZeRO-3's units)."""
        self.module = LocalModule(held)
        self.duplicate_parameters: list[nn.Parameter] = []
        """Tied parameters whose lowest holder is another rank (counted there in the norm)."""
        self._ties = self._setup_ties(stages, mine)
        self.tied_parameters = [p for p, _ in self._ties]
        release_layers([layer for s, st in enumerate(stages) if s not in mine for _, layer in st],
                       [layer for _, layer in held])
        self.holds_loss = any(schedule.is_last_stage(s) for s in mine)
        self.io = StageIO(model, loss_fn)
        params = list(self.module.parameters())
        # (``device`` given: the parameters may still be on the meta device, sharded init)
        self.device = device or (params[0].device if params else torch.device("cpu"))
        self.p2p = StageP2P(comm, schedule, self.rank, self.peers, self.device)
        self._eval_p2p: StageP2P | None = None   # the forward-only schedule's, built on first use
        self.track_memory = False
        """Book activation bytes per in-flight microbatch (``activation_peak_bytes``)."""
        self.tracker = ActivationTracker()
        self._kept: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (stage, mb) -> (in, out)
        self._weights: dict[tuple[int, int], PendingWeights] = {}        # I done, W to come
        self._chunk_params = {s: list({id(p): p for layer in c.layers for p in layer.parameters()
                                       if p.requires_grad}.values())
                              for s, c in self.chunks.items()}
        self._loss, self._count = 0.0, 0.0
        self.last_timeline: Timeline | None = Timeline([[] for _ in self.peers],
                                                       schedule.virtual_stages, "s", schedule.name)

    # ---------------------------------------------------------------- tied weights
    def _setup_ties(self, stages: list, mine: list[int]) -> list[tuple[nn.Parameter, Any]]:
        """Parameters shared by stages on different ranks: gradients summed over those ranks
        (the same dp, cp and tp coordinates), before the DP reduction, which holds them back
        until then (``hooks.expect_backwards``). Sums commute, so the result is the sum over
        every rank holding a copy, as one process's gradient of the shared weight.

        Every rank of the world creates the same groups in the same order (through the mesh:
        group creation is collective). The copies on all but the lowest such rank go into
        ``duplicate_parameters``.
        """
        shared = shared_stages(stages)
        if not shared:
            return []
        # the table's rule (checked before any worker for trainmesh train's models; here for a
        # model given to the Python API, whose cut is known only now)
        on_one_rank = ties_on_one_rank(shared, self.schedule.pp)
        table.check_facts(self.schedule, Facts(ties_on_one_rank=on_one_rank))
        rank_sets = sorted({tuple(sorted({self.schedule.stage_to_rank(s) for s in ss}))
                            for _, ss in shared})
        mesh = self.mesh
        groups = mesh.subgroups([[mesh.rank_of(dp=d, pp=k, cp=c, tp=t) for k in rs]
                                 for rs in rank_sets for d in range(mesh.layout.dp)
                                 for c in range(mesh.layout.cp) for t in range(mesh.layout.tp)])
        here = {"dp": mesh.index(Group.dp), "cp": mesh.index(Group.cp), "tp": mesh.index(Group.tp)}
        out = []
        for p, ss in shared:
            rs = tuple(sorted({self.schedule.stage_to_rank(s) for s in ss}))
            if self.rank in rs:
                if self.rank != rs[0]:
                    self.duplicate_parameters.append(p)
                out.append((p, groups[tuple(mesh.rank_of(pp=k, **here) for k in rs)]))
        return out

    def _reduce_ties(self, hooks: StepHooks) -> None:
        """After this rank's last backward: each tied gradient summed over the ranks sharing
        it, in the order of the model's parameters, then handed to the DP strategy."""
        for p, group in self._ties:
            if p.grad is not None:
                self.comm.all_reduce(p.grad, Group.pp, group=group)
            hooks.release(p)

    # ---------------------------------------------------------------- one step
    @property
    def activation_peak_bytes(self) -> int:
        """Peak activation bytes held for backward during the last step (``track_memory``)."""
        return self.tracker.peak_bytes

    def run(self, microbatches: list, hooks: StepHooks) -> tuple[float, float]:
        """Execute this rank's actions on the step's microbatches; (loss_sum, count) of this rank."""
        if len(microbatches) != self.schedule.microbatches:
            raise ConfigError("microbatches", f"the pipeline schedule expects "
                                              f"{self.schedule.microbatches}; got {len(microbatches)}")
        hooks.expect_backwards(len(microbatches), self.tied_parameters)
        if self.track_memory:
            self.tracker.reset(list(self.module.parameters()))
        self.p2p.begin(batch_key(microbatches[0]))
        self._kept.clear()
        self._loss, self._count = 0.0, 0.0
        row: list[TimedAction] = []
        for action in self.schedule.actions[self.rank]:
            with hooks.microbatch(action.microbatch):
                row.append(self._act(action, microbatches, hooks))
        self.p2p.finish()
        if self._kept or self._weights:
            raise RuntimeError(f"pipeline rank {self.rank}: activations never freed: "
                               f"{list(self._kept) + list(self._weights)}")
        self._reduce_ties(hooks)
        rows: list[list[TimedAction]] = [[] for _ in self.peers]
        rows[self.rank] = row
        self.last_timeline = Timeline(rows, self.schedule.virtual_stages, "s", self.schedule.name)
        return self._loss, self._count

    def _act(self, action: Action, microbatches: list, hooks: StepHooks) -> TimedAction:
        """One action of the schedule."""
        if action.kind == FORWARD:
            return self._forward(action, microbatches[action.microbatch], hooks)
        if action.kind == BACKWARD:
            return self._backward(action, hooks)
        if action.kind == BACKWARD_INPUT:
            return self._backward_input(action, hooks)
        return self._backward_weight(action, hooks)

    @torch.no_grad()
    def evaluate(self, microbatches: list, hooks: StepHooks) -> tuple[float, float]:
        """Forward-only schedule over the microbatches; (loss_sum, count) of this rank."""
        if len(microbatches) != self.schedule.microbatches:
            raise ConfigError("microbatches", f"the pipeline schedule expects "
                                              f"{self.schedule.microbatches}; got {len(microbatches)}")
        if self._eval_p2p is None:
            self._eval_p2p = StageP2P(self.comm, forward_only(self.schedule), self.rank,
                                      self.peers, self.device)
        p2p = self._eval_p2p
        p2p.begin(batch_key(microbatches[0]))
        loss, count = 0.0, 0.0
        for a in p2p.schedule.actions[self.rank]:
            s, batch = a.stage, microbatches[a.microbatch]
            first, last = self.schedule.is_first_stage(s), self.schedule.is_last_stage(s)
            x = self.io.input_of(batch) if first else p2p.take(("act", s, a.microbatch))
            with hooks.microbatch(a.microbatch), hooks.autocast():
                out = self.chunks[s](x, batch)             # (b, s, d) for the GPT
                if last:
                    loss_sum, n = self.io.loss(out, batch)
                    loss, count = loss + float(loss_sum), count + float(n)
            if not last:
                p2p.send(("act", s + 1, a.microbatch), out)
        p2p.finish()
        return loss, count

    def _forward(self, a: Action, batch: Any, hooks: StepHooks) -> TimedAction:
        s, i = a.stage, a.microbatch
        if self.schedule.is_first_stage(s):
            x = self.io.input_of(batch)
        else:
            x = self.p2p.take(("act", s, i))                    # (b, s, d) for the GPT
            x.requires_grad_(x.is_floating_point())
        start = time.perf_counter()
        last = self.schedule.is_last_stage(s)

        def compute() -> tuple[Any, torch.Tensor]:
            with hooks.autocast():
                out = self.chunks[s](x, batch)
                if not last:
                    return x, out
                loss_sum, count = self.io.loss(out, batch)
            self._loss += float(loss_sum.detach())
            self._count += float(count)
            return x, loss_sum

        kept = self.tracker.record((s, i), compute) if self.track_memory else compute()
        if not last:
            self.p2p.send(("act", s + 1, i), kept[1])
        self._kept[(s, i)] = kept
        return TimedAction(a, start, time.perf_counter())

    def _backward(self, a: Action, hooks: StepHooks) -> TimedAction:
        s, i = a.stage, a.microbatch
        x, out = self._kept.pop((s, i))
        hooks.backward_from(out, self._chunk_params[s])
        if self.schedule.is_last_stage(s):
            start = time.perf_counter()
            torch.autograd.backward(hooks.scale_loss(out))
        else:
            grad = self.p2p.take(("grad", s, i))               # d loss / d out, out's shape
            start = time.perf_counter()
            if out.requires_grad:
                torch.autograd.backward(out, grad_tensors=grad)
        if not self.schedule.is_first_stage(s):
            self.p2p.send(("grad", s - 1, i), x.grad if x.grad is not None else torch.zeros_like(x))
        self.tracker.free((s, i))
        del x, out
        return TimedAction(a, start, time.perf_counter())

    def _backward_input(self, a: Action, hooks: StepHooks) -> TimedAction:
        """``I``: the input gradient only, sent on; the weight gradients wait for ``W``."""
        s, i = a.stage, a.microbatch
        x, out = self._kept.pop((s, i))
        output = out                                            # walked at W
        if self.schedule.is_last_stage(s):
            start = time.perf_counter()
            out, grad = hooks.scale_loss(out), None
        else:
            grad = self.p2p.take(("grad", s, i))               # d loss / d out, out's shape
            start = time.perf_counter()
        first = self.schedule.is_first_stage(s)
        dx, self._weights[(s, i)] = backward_input(out, grad, None if first else x,
                                                   self._chunk_params[s])
        self._weights[(s, i)].output = output
        if not first:
            self.p2p.send(("grad", s - 1, i), dx if dx is not None else torch.zeros_like(x))
        del x, out, output, grad, dx
        return TimedAction(a, start, time.perf_counter())

    def _backward_weight(self, a: Action, hooks: StepHooks) -> TimedAction:
        """``W``: the weight gradients of an earlier ``I``; frees the microbatch's activations.
        The strategy learns here which parameters the microbatch leaves without a gradient, so
        they pass in this round of its reductions (docs/ZERO.md)."""
        pending = self._weights.pop((a.stage, a.microbatch))
        if pending.output is not None:
            hooks.backward_from(pending.output, self._chunk_params[a.stage])
        start = time.perf_counter()
        backward_weight(pending)
        self.tracker.free((a.stage, a.microbatch))
        return TimedAction(a, start, time.perf_counter())
