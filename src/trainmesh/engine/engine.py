"""Engine: the layout applied to a model, and one training step that knows no strategy by name.

It reads as its steps. Build: the layout applied to the model (:func:`~trainmesh.engine.
parallelize.parallelize`: tp, cp, ep, the sequence split, recompute, compile), this rank's
share of it (the executor: the whole model, or a pipeline stage), its values (:mod:`trainmesh.
engine.start`), the data-parallel strategy (``grad_sync``, :func:`~trainmesh.data_parallel.
make_grad_sync`) and its optimizer. Compute (docs/TRAINING.md, "One training step"): forward
and backward of this rank's microbatches while the strategy reduces gradients in buckets; the
loss and token count summed over the world in one all-reduce (with whatever the strategy adds
to it); gradients scaled to the mean over the strategy's tokens; under sequence parallelism the
partial gradients of replicated parameters summed over tp; the norm the strategy clips by.
Apply: clip, step, schedule; the step's :class:`~trainmesh.core.step.StepReport` returned.
Discard: the step dropped. Evaluate: forward only. A strategy that differs (DiLoCo: each
replica's own tokens and norm) overrides the seam's hooks (:class:`~trainmesh.data_parallel.
base.GradSync`). Accounting, traces and checkpoints: the ``Accounting`` and ``Checkpointing``
mixins. Groups come from the axis table (:mod:`trainmesh.core.axes`); each parameter's place on
the mesh is one :class:`~trainmesh.core.placement.Placement` per name in ``engine.placements``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.axes import kind_groups
from trainmesh.core.errors import ConfigError
from trainmesh.core.hub_state import init_of, moe_stats_of
from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.placement import Placements
from trainmesh.core.randomness import Draws, drawing
from trainmesh.core.step import Across, Executor, LossFn, StepHooks, StepReport, StepResult
from trainmesh.data.corpus import split_microbatches
from trainmesh.data_parallel import frozen_named_parameters, make_grad_sync, unique_named_parameters
from trainmesh.data_parallel.base import OptimizerFactory
from trainmesh.data_parallel.whole_maps import install as whole_matrices
from trainmesh.data_parallel.whole_params import declared
from trainmesh.data_parallel.readiness import reached
from trainmesh.engine.accounting import Accounting
from trainmesh.engine.checkpointing import Checkpointing
from trainmesh.engine.draws import microbatch_draws
from trainmesh.engine.executor import build_executor
from trainmesh.engine.materialize import InitFn
from trainmesh.engine.moe_metrics import MoEMetrics, model_stats
from trainmesh.engine.parallelize import parallelize
from trainmesh.engine.partial_grads import complete_partial_grads, counted_in_norm, unused_reach
from trainmesh.engine.precision import Precision
from trainmesh.engine.pretrained import check_tp_first_layer
from trainmesh.engine.start import broadcast_from_root, keep_buffers_in_step, mark_duplicates, sharded_init
from trainmesh.engine.train_state import TrainState
from trainmesh.models.hf_random import install_draws
from trainmesh.observe.flops import model_flops_per_token


class Engine(Accounting, Checkpointing):
    """Trains ``model`` under ``config`` on the mesh (docs/API.md)."""

    def __init__(self, model: nn.Module, optimizer: OptimizerFactory, loss_fn: LossFn,
                 config: ParallelConfig | None = None, *,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 param_groups: Callable[[str], dict] | None = None,
                 mesh: ParallelMesh | None = None, tp_plan: dict[str, str] | None = None,
                 broadcast_init: bool = True, flops_per_token: float | None = None,
                 init_fn: InitFn | None = None, device: torch.device | str | None = None,
                 seed: int = 0, first_layer_checked: bool = False) -> None:
        cfg = config or ParallelConfig()
        if tp_plan is None and not first_layer_checked:   # a hub model's inferred or file's plan
            check_tp_first_layer(model, cfg.tp)       # as the preflight does, before any collective
        if moe_stats_of(model) is not None and not cfg.find_unused_parameters:
            # an expert no token reached has no gradient that step (models/moe.py)
            cfg = dataclasses.replace(cfg, find_unused_parameters=True)
        self.config = cfg
        self.flops_per_token = model_flops_per_token(model, flops_per_token)
        """Training FLOPs per token of the whole model (MFU): given, the model's own
        ``flops_per_token()``, or None (:mod:`trainmesh.observe.flops`)."""
        self.mesh = mesh or cfg.build_mesh()
        self.comm = Comm(self.mesh)
        self.replica_axis = kind_groups(self.mesh.layout, "dense").holders
        """The ranks holding replicas of the dense parameters, each with other tokens (dp x cp)."""
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "meta":
            self.device = torch.device("cpu")
        self.precision = Precision(cfg, self.device)
        self.placements = Placements()
        """Each parameter's place on the mesh, by name (filled by the TP and pipeline split)."""
        self.seed = seed
        """The run's seed: dropout and router noise are drawn from it by position."""
        self.norm_dtype = (torch.float64 if any(p.dtype == torch.float64 for p in model.parameters())
                           else torch.float32)
        """The squared gradient norm's dtype on the wire: float32, a float64 model's float64."""
        self.random = install_draws(model)
        """A Hugging Face model's dropout and router noise, now drawn by position: what was
        replaced (one line each) and where each module draws."""
        self._draws: list[Draws | None] = []
        self.model = parallelize(model, cfg, mesh=self.mesh, comm=self.comm,
                                 placements=self.placements, device=self.device, tp_plan=tp_plan,
                                 installed=self.random)
        self.executor: Executor = build_executor(self.model, loss_fn, cfg, self.comm, self.device)
        self._counted = counted_in_norm(self.placements, self.mesh.index(Group.tp))
        self.module: nn.Module = self.executor.module
        named = unique_named_parameters(self.module)
        self.frozen = frozen_named_parameters(self.module)
        """Parameters with ``requires_grad=False``: whole on every DP rank, no sync, no optimizer."""
        if not named:   # a pipeline stage of frozen layers only: no optimizer to build
            raise ConfigError("model", f"no trainable parameter on rank {self.mesh.rank} "
                              f"(pipeline stage {self.mesh.index(Group.pp)}); valid: every stage "
                              "holds one with requires_grad=True (move the split, or fewer --pp)")
        mark_duplicates(named, self.executor.duplicate_parameters, self.placements)
        fill = sharded_init(self.module, named, self.frozen,
                            init_fn or init_of(model), device=self.device,
                            placements=self.placements, later=cfg.zero >= 3)
        if broadcast_init and fill is None:
            broadcast_from_root(named + self.frozen, self.comm, self.placements)
        if cfg.broadcast_buffers and self.mesh.size(self.replica_axis) > 1:
            keep_buffers_in_step(self.module, self.comm, self.replica_axis)
        self.grad_sync = make_grad_sync(cfg, named, self.comm, module=self.module,
                                        precision=self.precision, materialize=fill,
                                        device=self.device, kind_of=self.placements.kind,
                                        layers=getattr(self.executor, "layer_names", None))
        """The data-parallel strategy: one per kind of parameter, over its kind's groups."""
        self.hooks = StepHooks(autocast=self.precision.autocast, scale_loss=self.precision.scale_loss,
                               before_backward=self.grad_sync.before_backward,
                               expect_backwards=self.grad_sync.expect_backwards,
                               release=self.grad_sync.release, microbatch=self._microbatch,
                               **({"backward_from": self._pass_unreached}
                                  if cfg.find_unused_parameters else {}))
        self.optimizer = self.grad_sync.build_optimizer(declared(optimizer), param_groups)
        whole_matrices(self.grad_sync, self.comm, self.placements)   # Muon: NS on whole matrices
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler else None
        self.moe = MoEMetrics(model_stats(model), self.comm)
        """The MoE layers' aux loss and routing counts, per step and over the run."""
        self.state = TrainState(self.optimizer, self.lr_scheduler, self.precision, self.device)
        """Step count, learning rates, LR schedule, loss scaler, RNG: saved and restored as one."""
        self.report: StepReport | None = None
        """The last step's :class:`StepReport` (None before the first)."""
        self.state_bytes = {"params": 0, "grads": 0, "optimizer": 0}
        self.offloaded_bytes = {"cpu": 0, "nvme": 0}
        """Model-state bytes kept off the compute device (--offload), measured with state_bytes."""

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (:attr:`state`)."""
        return self.state.step

    @property
    def last(self) -> Mapping[str, Any]:
        """The last step's metrics (read-only; empty before the first): :attr:`report`'s."""
        return self.report.metrics() if self.report is not None else {}

    def _pass_unreached(self, root: torch.Tensor, params: list[nn.Parameter] | None) -> None:
        """Before a backward pass (unused parameters allowed): the parameters its graph leaves
        without a gradient pass it at once (:mod:`trainmesh.data_parallel.readiness`)."""
        self.grad_sync.pass_unreached(reached([root]),
                                      None if params is None else {id(p) for p in params})

    # ---------------------------------------------------------------- one step
    def train_step(self, batch: Any = None, *, microbatches: list | None = None) -> float:
        """One optimizer step on this DP rank's ``batch`` (a tensor, a tuple/list of tensors or a
        dict, split along dim 0 into ``config.microbatches``), or on ``microbatches`` already
        split by the caller; returns the global-batch loss."""
        return self.step(batch, microbatches=microbatches).loss

    def step(self, batch: Any = None, *, microbatches: list | None = None) -> StepReport:
        """:meth:`train_step`, returning the step's :class:`StepReport`."""
        if (batch is None) == (microbatches is None):
            raise TypeError("train_step takes a batch or microbatches=[...], exactly one of them")
        if microbatches is None:
            microbatches = split_microbatches(batch, self.config.microbatches)
        return self.apply(self.compute(microbatches))

    def compute(self, microbatches: list, across: Across | None = None) -> StepResult:
        """The step up to, not including, its update: forward and backward of this rank's
        ``microbatches``; the loss, the token count and the gradient summed over the world (and,
        given ``across``, over the fault-tolerant replicas: after the world's sums, before
        anything depends on them) and scaled to the mean over the tokens the strategy averages
        over (every token of the global batch, :meth:`~trainmesh.data_parallel.base.GradSync.
        token_total`); the norm the strategy clips by and fp16's overflow decided. Nothing of
        the training state changes: :meth:`apply` takes the step, :meth:`discard` drops it."""
        sync = self.grad_sync
        microbatches = self._cp_share(microbatches)
        self._draws = self._microbatch_draws(microbatches)
        self.comm.ledger.begin_step()
        self.moe.begin_step(self.precision.loss_scale)
        loss_sum, count = self.executor.run(microbatches, self.hooks)
        holds_loss = self.executor.holds_loss and self.mesh.index(Group.tp) == 0
        sums = [loss_sum, count] if holds_loss else [0.0, 0.0]
        unused = sync.unused_counts() if self.config.find_unused_parameters else []
        # rides along: each strategy part's "any unused?", as many on every rank (a pipeline
        # stage without experts holds one strategy where the others hold two)
        width = (2 if self.config.ep > 1 else 1) if unused else 0
        sums += [float(n) for n in unused] + [0.0] * (width - len(unused))
        extra = sync.extra_sums(count if holds_loss else 0.0)   # rides along too
        totals = torch.tensor(sums + extra, dtype=torch.float64)
        self.comm.all_reduce(totals, Group.world)
        if across is not None:
            across(totals)
        global_loss, tokens = (totals[0] / totals[1]).item(), totals[1].item()
        # a parameter no rank of any replica present used gets no update (the same on each)
        sync.agree_unused([totals[2 + i].item() > 0 for i in range(len(unused))],
                          across=unused_reach(self.placements, self.comm, across))
        tokens = sync.token_total(tokens, totals[len(sums):].tolist())
        sync.finish(1.0 / (tokens * self.precision.loss_scale))
        if across is not None:   # linear: the same whether before or after finish's scaling
            for g in sync.reduced_grads():
                across(g)
        complete_partial_grads(self.placements, self.comm, sync.grads_of)
        self.state_bytes = self.measure_state()
        self.offloaded_bytes = sync.offloaded_bytes()
        overflow = self.precision.overflowed(sync.grads_finite, self._all_reduce_min)  # lazy: fp16 only
        norm = 0.0 if overflow else sync.norm(self._counted, self.grad_norm)
        moe = self.moe.reduce(holds=self.mesh.index(Group.tp) == 0 or self.config.sequence_parallel,
                              across=across)
        return StepResult(global_loss, norm, overflow, self._nonfinite(global_loss, norm, overflow), moe)

    def apply(self, result: StepResult) -> StepReport:
        """Take the step :meth:`compute` prepared: the loss scaler moves, the gradients are
        clipped by the norm and the optimizer steps (unless fp16 overflowed or the step is
        non-finite: never applied, the caller's policy decides), then the LR schedule and the
        step count. Returns the step's :class:`StepReport` (also kept as :attr:`report`)."""
        self.precision.commit(result.overflow)
        skip = result.overflow or result.nonfinite is not None
        norm = result.grad_norm
        if not skip:
            if self.config.grad_clip > 0 and norm > self.config.grad_clip:
                self.grad_sync.clip(self.config.grad_clip / (norm + 1e-6))
            self.grad_sync.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.state.advance(applied=not skip)
        self.grad_sync.zero_grad()
        moe = self.moe.record(result.moe)
        self.comm.end_step()   # with TRAINMESH_CHECK_COLLECTIVES=1: the ranks compare their collectives
        extra = self.grad_sync.step_metrics(norm)
        self.report = StepReport(result.loss, extra.pop("grad_norm", norm), lr,
                                 precision=self.precision.metrics(), extra=extra,
                                 nonfinite=result.nonfinite, moe=moe)
        return self.report

    def discard(self) -> None:
        """Drop the step :meth:`compute` prepared: the gradients are zeroed, the weights, the
        optimizer, the schedule and the loss scaler stay as they were (the step is attempted
        again)."""
        self.grad_sync.zero_grad()
        self.comm.end_step()

    def _cp_share(self, microbatches: list) -> list:
        """Context parallelism: this CP rank's two zigzag chunks of every sequence (dim 1 of
        every tensor of two or more dimensions) of each microbatch."""
        cp = self.mesh.size(Group.cp)
        if cp == 1:
            return microbatches
        from trainmesh.context_parallel import shard_batch
        return [shard_batch(mb, self.mesh.index(Group.cp), cp) for mb in microbatches]

    def _microbatch_draws(self, microbatches: list) -> list[Draws | None]:
        """Where each microbatch's elements sit in the global batch (:mod:`.draws`)."""
        return microbatch_draws(microbatches, seed=self.seed, step=self.state.step,
                                share=self.batch_share(), mesh=self.mesh,
                                sequence_parallel=self.config.sequence_parallel, device=self.device)

    def _microbatch(self, i: int) -> AbstractContextManager[None]:
        """Around microbatch ``i``'s passes: its :class:`Draws`."""
        return drawing(self._draws[i] if i < len(self._draws) else None)

    def _nonfinite(self, loss: float, norm: float, overflow: bool) -> str | None:
        """What makes this step non-finite (the same on every rank: all inputs are reduced)."""
        if not math.isfinite(loss):
            return f"loss {loss}"
        if not math.isfinite(norm):
            return f"grad_norm {norm}"
        return self.precision.nonfinite(overflow)

    def evaluate(self, batches: list[Any]) -> float:
        """Mean loss over every token of this DP rank's ``batches`` and the other ranks': forward
        only, through the executor (a pipeline runs its forward-only schedule); no gradients,
        no optimizer state touched. Collective over the world."""
        loss_sum, count = 0.0, 0.0
        for batch in batches:
            microbatches = self._cp_share(split_microbatches(batch, self.config.microbatches))
            self._draws = self._microbatch_draws(microbatches)
            s, n = self.executor.evaluate(microbatches, self.hooks)
            loss_sum, count = loss_sum + s, count + n
        holds_loss = self.executor.holds_loss and self.mesh.index(Group.tp) == 0
        totals = torch.tensor([loss_sum, count] if holds_loss else [0.0, 0.0], dtype=torch.float64)
        self.comm.all_reduce(totals, Group.world)
        return (totals[0] / totals[1]).item()

    def local_grad_sq_sum(self) -> torch.Tensor:
        """This rank's part of the squared gradient norm (each logical parameter counted once
        over the mesh); :meth:`grad_norm` sums it over the world."""
        return self.grad_sync.grad_sq_sum(self._counted)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient, each logical parameter counted once."""
        sq = self.local_grad_sq_sum().reshape(1).to(self.norm_dtype)
        self.comm.all_reduce(sq, Group.world)
        return math.sqrt(float(sq))
