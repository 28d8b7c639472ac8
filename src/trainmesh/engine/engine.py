"""Engine: composes the mesh, tensor/pipeline parallelism and a DP strategy into one train step.

One step (docs/TRAINING.md, "One training step"): split this DP rank's batch into microbatches; run
forward and backward (locally, or through the pipeline schedule) while the DP strategy reduces
gradients in buckets; sum the loss and token count over the world; scale gradients to the mean
over every token of the global batch; under sequence parallelism, sum the partial gradients of
replicated parameters over tp (:meth:`Engine._complete_partial_grads`); measure the global gradient norm (each logical parameter
once) and clip; step the optimizer. Every layer it composes uses only its own mesh axis. Under
context parallelism each CP rank keeps its two zigzag chunks of every sequence
(:meth:`Engine._cp_share`), attention runs over the CP group (:mod:`trainmesh.context_parallel`)
and the replicas of the parameters are the dp x cp ranks (``replica_axis``). Which group each
kind of parameter is reduced over, broadcast from and held by is the axis table's
(:mod:`trainmesh.core.axes`).

The seams: the executor (:mod:`trainmesh.core.step`: local or a pipeline stage) runs the passes and
reaches the precision policy and the DP strategy only through the :class:`~trainmesh.core.step.
StepHooks` the engine binds; the engine alone drives the strategy (``grad_sync``);
checkpoints get the strategy, the communication layer and the trainer state, never the engine.
Where each parameter lives across the mesh (tensor-parallel slice, partial gradient, pipeline
duplicate) is one :class:`~trainmesh.core.placement.Placement` per name in ``engine.placements``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.checkpoint import sharded as checkpoint
from trainmesh.checkpoint.async_save import AsyncSaver
from trainmesh.checkpoint.export_hf import model_record
from trainmesh.comm import Comm
from trainmesh.comm.ledger import Span
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.axes import LATER, kind_groups, sequence_groups
from trainmesh.core.errors import ConfigError
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.placement import Placements
from trainmesh.core.step import Across, Executor, LossFn, StepHooks, StepResult
from trainmesh.data.corpus import split_microbatches
from trainmesh.data_parallel import (
    frozen_named_parameters,
    make_grad_sync,
    unique_named_parameters,
    untrained_state,
)
from trainmesh.data_parallel.base import OptimizerFactory
from trainmesh.data_parallel.readiness import reached
from trainmesh.engine.executor import LocalExecutor
from trainmesh.engine.materialize import InitFn, materialize, materialize_buffers
from trainmesh.engine.moe_metrics import MoEMetrics, model_stats
from trainmesh.engine.precision import Precision
from trainmesh.engine.train_state import TrainState
from trainmesh.observe.flops import model_flops_per_token
from trainmesh.observe.metrics import storage_bytes

if TYPE_CHECKING:
    from trainmesh.pipeline_parallel.schedules import Timeline

class Engine:
    """Trains ``model`` under ``config`` on the mesh (docs/API.md)."""

    def __init__(self, model: nn.Module, optimizer: OptimizerFactory, loss_fn: LossFn,
                 config: ParallelConfig | None = None, *,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 param_groups: Callable[[str], dict] | None = None,
                 mesh: ParallelMesh | None = None, tp_plan: dict[str, str] | None = None,
                 broadcast_init: bool = True, flops_per_token: float | None = None,
                 init_fn: InitFn | None = None, device: torch.device | str | None = None) -> None:
        cfg = config or ParallelConfig()
        if getattr(model, "moe_stats", None) is not None and not cfg.find_unused_parameters:
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
        self.model = self._split_layers(model, tp_plan)
        self.executor: Executor = self._build_executor(self.model, loss_fn)
        self.module: nn.Module = self.executor.module
        named = unique_named_parameters(self.module)
        self.frozen = frozen_named_parameters(self.module)
        """Parameters with ``requires_grad=False``: whole on every DP rank, no sync, no optimizer."""
        if not named:   # a pipeline stage of frozen layers only: no optimizer to build
            raise ConfigError("model", f"no trainable parameter on rank {self.mesh.rank} "
                              f"(pipeline stage {self.mesh.index('pp')}); valid: every stage "
                              "holds one with requires_grad=True (move the split, or fewer --pp)")
        self._mark_duplicates(named)
        fill = self._sharded_init(named, init_fn or getattr(model, "init_parameter", None))
        if broadcast_init and fill is None:
            self._broadcast_from_dp_root(named + self.frozen)
        if cfg.broadcast_buffers and self.mesh.size(self.replica_axis) > 1:
            self._broadcast_buffers()
            self.module.register_forward_pre_hook(self._buffers_before_forward)
        if self.executor.tied_parameters and cfg.zero >= 2:
            raise ConfigError("zero", "tied weights across pipeline stages need --zero 0 or 1 "
                              "(their gradients are summed over stages before sharding)")
        self.grad_sync = self._make_grad_sync(named, fill)
        self.hooks = StepHooks(autocast=self.precision.autocast, scale_loss=self.precision.scale_loss,
                               before_backward=self.grad_sync.before_backward,
                               expect_backwards=self.grad_sync.expect_backwards,
                               release=self.grad_sync.release,
                               **({"backward_from": self._pass_unreached}
                                  if cfg.find_unused_parameters else {}))
        self.optimizer = self.grad_sync.build_optimizer(optimizer, param_groups)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler else None
        self.moe = MoEMetrics(model_stats(model), self.comm)
        """The MoE layers' aux loss and routing counts, per step and over the run."""
        self.state = TrainState(self.optimizer, self.lr_scheduler, self.precision, self.device)
        """Step count, learning rates, LR schedule, loss scaler, RNG: saved and restored as one."""
        self.last: dict[str, Any] = {}
        self.state_bytes = {"params": 0, "grads": 0, "optimizer": 0}
        self.offloaded_bytes = {"cpu": 0, "nvme": 0}
        """Model-state bytes kept off the compute device (--offload), measured with state_bytes."""

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (:attr:`state`)."""
        return self.state.step

    # ---------------------------------------------------------------- set-up
    def _split_layers(self, model: nn.Module, tp_plan: dict[str, str] | None) -> nn.Module:
        """Tensor parallelism (the model's own plan unless ``tp_plan``), context parallelism,
        recomputation and compilation, in place."""
        cfg = self.config
        if cfg.tp > 1:
            from trainmesh.tensor_parallel import parallelize
            parallelize(model, self.mesh, self.comm, plan=tp_plan,
                        sequence_parallel=cfg.sequence_parallel, placements=self.placements)
        if cfg.cp > 1:   # attention over the CP group's whole sequence, positions global
            from trainmesh.context_parallel import apply_context_parallel
            apply_context_parallel(model, self.mesh, self.comm, mode=cfg.cp_comm, device=self.device)
        if cfg.ep > 1:
            from trainmesh.expert_parallel import shard_experts
            shard_experts(model, self.comm, self.placements)
        split = sequence_groups(self.mesh.layout, cfg.sequence_parallel)
        if split:        # MoE layers sum their per-sequence counts over the sequence's parts
            from trainmesh.expert_parallel.sequence import split_sequences
            split_sequences(model, self.comm, split)
        if cfg.recompute != "none":
            from trainmesh.engine.recompute import apply_recompute
            apply_recompute(model, cfg.recompute, segment=cfg.recompute_segment)
        if cfg.compile:   # last: compiles the layers as TP and recomputation left them
            from trainmesh.engine.compile import compile_layers
            compile_layers(model, self.device.type, self.comm, backend=cfg.compile_backend)
        return model

    def _make_grad_sync(self, named: list[tuple[str, nn.Parameter]],
                        fill: Callable[[list[tuple[str, nn.Parameter]]], None] | None):
        """The DP strategy: one per kind of parameter (dense; experts under expert parallelism),
        each over its kind's groups, composed as one (:func:`make_grad_sync`)."""
        return make_grad_sync(self.config, named, self.comm, module=self.module,
                              precision=self.precision, materialize=fill, device=self.device,
                              layers=getattr(self.executor, "layer_names", None),
                              kind_of=self.placements.kind)

    def _build_executor(self, model: nn.Module, loss_fn: LossFn) -> Executor:
        """This rank's share of the model and how a step runs it: a pipeline stage or all of it."""
        cfg = self.config
        if cfg.pp == 1:
            return LocalExecutor(model, loss_fn)
        from trainmesh.pipeline_parallel.runtime import PipelineExecutor
        from trainmesh.pipeline_parallel.schedules import build_schedule
        schedule = build_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
        return PipelineExecutor(model, loss_fn, self.mesh, self.comm, schedule, device=self.device)

    def _sharded_init(self, named: list[tuple[str, nn.Parameter]], init: InitFn | None
                      ) -> Callable[[list[tuple[str, nn.Parameter]]], None] | None:
        """A model on the meta device: give this rank's parameters (after the tensor and pipeline
        split) their values from ``init``, or leave that to ZeRO-3, unit by unit (returns the
        function it calls). Frozen parameters and meta buffers get theirs here at every stage
        (the same init on every rank: nothing shards them). None when nothing is on meta."""
        tensors = [*(p for _, p in named + self.frozen), *self.module.buffers()]
        if not any(t.is_meta for t in tensors):
            return None
        if init is None:
            raise ConfigError("model", "parameters on the meta device need an init function "
                              "(Engine(init_fn=...) or a model.init_parameter(name, shape, index))")
        fill = partial(materialize, init=init, device=self.device, placements=self.placements)
        fill(self.frozen)
        materialize_buffers(self.module, init, self.device)
        if self.config.zero < 3:
            fill(named)
        return fill

    @torch.no_grad()
    def _broadcast_from_dp_root(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Identical start on every DP replica, whatever the user's init (set-up traffic)."""
        if self.mesh.size(self.replica_axis) == 1:
            return
        for name, p in named:     # from the first of the ranks holding it (its kind's holders)
            axis = kind_groups(self.mesh.layout, self.placements.kind(name)).holders
            self.comm.broadcast(p.data, axis, src=self.mesh.ranks(axis)[0])

    def _mark_duplicates(self, named: list[tuple[str, nn.Parameter]]) -> None:
        """Pipeline ties held on several ranks: record this rank's copy as a duplicate."""
        duplicates = {id(p) for p in self.executor.duplicate_parameters}
        for name, p in named:
            if id(p) in duplicates:
                self.placements.mark(name, tuple(p.shape), duplicate=True)

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """Every floating or integer buffer (BatchNorm statistics, counters) from the DP root,
        as DDP's ``broadcast_buffers``; one collective per buffer, in registration order."""
        axis = self.replica_axis
        root = self.mesh.ranks(axis)[0]
        for _, b in self.module.named_buffers():
            if b.numel() and not b.is_meta:
                self.comm.broadcast(b.data, axis, src=root)

    def _buffers_before_forward(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():       # a training forward (evaluation keeps its own)
            self._broadcast_buffers()

    def _pass_unreached(self, root: torch.Tensor, params: list[nn.Parameter] | None) -> None:
        """Before a backward pass (unused parameters allowed): the parameters its graph leaves
        without a gradient pass it at once (:mod:`trainmesh.data_parallel.readiness`)."""
        self.grad_sync.pass_unreached(reached([root]),
                                      None if params is None else {id(p) for p in params})

    def _counted_in_norm(self, name: str, p: nn.Parameter) -> bool:
        """Whether this rank counts ``p`` in the global norm: duplicates only once (the axis
        table's ``LATER``), a tp shard on every TP rank, a replicated parameter on the first."""
        placement = self.placements.get(name)
        if placement is not None and placement.duplicate and not LATER["duplicate"].counted:
            return False
        return (placement is not None and placement.sharded) or self.mesh.index("tp") == 0

    def _complete_partial_grads(self) -> None:
        """Sequence parallelism: each TP rank holds the gradient of its sequence chunk for the
        replicated parameters that run on chunks; sum them over tp, by name order, in one flat
        all-reduce. After the DP reduction (both are sums, so they commute), on whatever holds
        the reduced gradient: whole gradients, or, under ZeRO-2/3, this rank's pieces of the
        gradient shard (the same pieces on every rank of a TP group)."""
        names = self.placements.partial_grad_names()
        if names and self.mesh.size("tp") > 1:
            from trainmesh.tensor_parallel.state import sum_partial_grads
            sum_partial_grads(self.grad_sync.grads_of(names), self.comm, LATER["partial_grad"].then)

    # ---------------------------------------------------------------- one step
    def train_step(self, batch: Any = None, *, microbatches: list | None = None) -> float:
        """One optimizer step on this DP rank's ``batch`` (a tensor, a tuple/list of tensors or a
        dict, split along dim 0 into ``config.microbatches``), or on ``microbatches`` already
        split by the caller; returns the global-batch loss."""
        if (batch is None) == (microbatches is None):
            raise TypeError("train_step takes a batch or microbatches=[...], exactly one of them")
        if microbatches is None:
            microbatches = split_microbatches(batch, self.config.microbatches)
        return self.apply(self.compute(microbatches))

    def compute(self, microbatches: list, across: Across | None = None) -> StepResult:
        """The step up to, not including, its update: forward and backward of this rank's
        ``microbatches``; the loss, the token count and the gradient summed over the world (and,
        given ``across``, over the fault-tolerant replicas: after the world's sums, before
        anything depends on them) and scaled to the mean over every token of the global batch;
        the global norm and fp16's overflow decided. Nothing of the training state changes:
        :meth:`apply` takes the step, :meth:`discard` drops it."""
        microbatches = self._cp_share(microbatches)
        self.comm.ledger.begin_step()
        self.moe.begin_step(self.precision.loss_scale)
        loss_sum, count = self.executor.run(microbatches, self.hooks)
        holds_loss = self.executor.holds_loss and self.mesh.index("tp") == 0
        sums = [loss_sum, count] if holds_loss else [0.0, 0.0]
        unused = self.grad_sync.unused_counts() if self.config.find_unused_parameters else []
        # rides along: each strategy part's "any unused?", as many on every rank (a pipeline
        # stage without experts holds one strategy where the others hold two)
        width = (2 if self.config.ep > 1 else 1) if unused else 0
        sums += [float(n) for n in unused] + [0.0] * (width - len(unused))
        diloco = self.config.strategy == "diloco"   # each replica: the mean over its own tokens
        if diloco:                                  # rides along: each replica's token count
            sums += self.grad_sync.replica_slots(count if holds_loss else 0.0)
        totals = torch.tensor(sums, dtype=torch.float64)
        self.comm.all_reduce(totals, "world")
        if across is not None:
            across(totals)
        global_loss, tokens = (totals[0] / totals[1]).item(), totals[1].item()
        # a parameter no rank of any replica present used gets no update (the same on each)
        self.grad_sync.agree_unused([totals[2 + i].item() > 0 for i in range(len(unused))],
                                    across=across)
        if diloco:   # the mean over the replica's own tokens
            tokens = totals[len(sums) - self.grad_sync.n_replicas + self.grad_sync.replica].item()
        self.grad_sync.finish(1.0 / (tokens * self.precision.loss_scale))
        if across is not None:   # linear: the same whether before or after finish's scaling
            for g in self.grad_sync.reduced_grads():
                across(g)
        self._complete_partial_grads()
        self.state_bytes = self.measure_state()
        self.offloaded_bytes = self.grad_sync.offloaded_bytes()
        overflow = self.precision.overflowed(self.grad_sync.grads_finite, self._all_reduce_min)  # lazy: fp16 only
        norm = 0.0 if overflow else (self.grad_sync.local_norm(self._counted_in_norm) if diloco
                                     else self.grad_norm())
        moe = self.moe.reduce(holds=self.mesh.index("tp") == 0 or self.config.sequence_parallel,
                              across=across)
        return StepResult(global_loss, norm, overflow, self._nonfinite(global_loss, norm, overflow), moe)

    def apply(self, result: StepResult) -> float:
        """Take the step :meth:`compute` prepared: the loss scaler moves, the gradients are
        clipped by the global norm and the optimizer steps (unless fp16 overflowed or the step
        is non-finite: never applied, the caller's policy decides), then the LR schedule and
        the step count. Returns the step's loss."""
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
        self.last = {"loss": result.loss, "grad_norm": norm, "lr": lr, **self.precision.metrics()}
        if self.config.strategy == "diloco":   # no global gradient; "outer" marks the steps that synchronised
            self.last.update(grad_norm=None, **({"outer": True} if self.grad_sync.synced else {}))
        if result.nonfinite:
            self.last["nonfinite"] = result.nonfinite
        if moe is not None:
            self.last["moe"] = moe
        return result.loss

    def discard(self) -> None:
        """Drop the step :meth:`compute` prepared: the gradients are zeroed, the weights, the
        optimizer, the schedule and the loss scaler stay as they were (the step is attempted
        again)."""
        self.grad_sync.zero_grad()
        self.comm.end_step()

    def _cp_share(self, microbatches: list) -> list:
        """Context parallelism: this CP rank's two zigzag chunks of every sequence (dim 1 of
        every tensor of two or more dimensions) of each microbatch."""
        cp = self.mesh.size("cp")
        if cp == 1:
            return microbatches
        from trainmesh.context_parallel import shard_batch
        return [shard_batch(mb, self.mesh.index("cp"), cp) for mb in microbatches]

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
            s, n = self.executor.evaluate(microbatches, self.hooks)
            loss_sum, count = loss_sum + s, count + n
        holds_loss = self.executor.holds_loss and self.mesh.index("tp") == 0
        totals = torch.tensor([loss_sum, count] if holds_loss else [0.0, 0.0], dtype=torch.float64)
        self.comm.all_reduce(totals, "world")
        return (totals[0] / totals[1]).item()

    def _all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce(t, "world", op=dist.ReduceOp.MIN)
        return t

    def local_grad_sq_sum(self) -> torch.Tensor:
        """This rank's part of the squared gradient norm (each logical parameter counted once
        over the mesh); :meth:`grad_norm` sums it over the world."""
        return self.grad_sync.grad_sq_sum(self._counted_in_norm)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient, each logical parameter counted once."""
        sq = self.local_grad_sq_sum().reshape(1).to(torch.float32)
        self.comm.all_reduce(sq, "world")
        return math.sqrt(float(sq))

    # ---------------------------------------------------------------- accounting
    def measure_state(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (distinct storages)."""
        held = self.grad_sync.held_tensors()
        seen: set[int] = set()
        return {k: storage_bytes(held[k], seen) for k in ("params", "grads", "optimizer")}

    @property
    def comm_buffer_peak_bytes(self) -> int:
        """Peak bytes of transient communication buffers (buckets, gathered ZeRO-3 units)."""
        return self.grad_sync.comm_buffer_peak_bytes

    def comm_bytes_per_step(self) -> dict[str, dict[str, float]]:
        """Payload bytes this rank passed to each op, averaged over the steps, by mesh axis."""
        return self.comm.ledger.bytes_per_step()

    def last_step_traffic(self) -> dict[str, Any]:
        """The communication ledger's record of the last step (axis -> op -> stats)."""
        return self.comm.ledger.steps[-1]

    def trace_comm(self, enabled: bool = True) -> None:
        """Keep a span (issue to completion, axis, op, bytes) of every communication op of the
        steps that follow (``--trace-out``), until called with ``False``."""
        self.comm.ledger.tracing = enabled

    def last_step_spans(self) -> list[Span]:
        """The communication spans of the last step (empty unless :meth:`trace_comm` was on)."""
        ledger = self.comm.ledger
        return [s for s in ledger.spans if s.step == ledger.closed - 1]

    @property
    def last_timeline(self) -> Timeline | None:
        """This rank's measured forward/backward spans of the last step (a pipeline's: one row
        per stage rank), None before the first step."""
        return self.executor.last_timeline

    def async_saver(self) -> AsyncSaver:
        """A saver for :meth:`save` that writes checkpoints in the background (``--async-save``)."""
        return AsyncSaver(self.comm)

    def gather_object(self, obj: Any) -> list[Any]:
        """Collective: ``obj`` of every rank of the world, in rank order."""
        return self.comm.all_gather_object(obj)

    def state_is_finite(self) -> bool:
        """Collective: whether every rank's parameters and optimizer states are all finite."""
        held = self.grad_sync.held_tensors()
        finite = all(bool(torch.isfinite(t).all()) for k in ("params", "optimizer") for t in held[k])
        flag = torch.tensor([1.0 if finite else 0.0])
        self._all_reduce_min(flag)
        return flag.item() >= 1.0

    def write_timeline(self, path: str) -> None:
        """Collective (pipeline runs): the measured per-rank timeline of the last step, drawn
        by rank 0 to ``path`` (.svg or .png)."""
        from trainmesh.pipeline_parallel.timeline import write_timeline
        write_timeline(self.executor, self.comm, path)

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str, trainer_state: dict[str, Any] | None = None, *,
             saver: Any | None = None, measure: dict[str, Any] | None = None):
        """Collective: write a checkpoint under ``path`` (:mod:`trainmesh.checkpoint.sharded`), return
        its directory; ``saver`` (an AsyncSaver): snapshot, write in the background, return the
        blocking seconds; ``measure``: filled on rank 0 with the memory the save added."""
        return (checkpoint.save if saver is None else saver.save)(
                     path, self.grad_sync, self.comm, step=self.step_count, measure=measure,
                     layout=self.config.layout_record(), placements=self.placements,
                     untrained=untrained_state(self.module),
                     # the whole model's record (tied aliases, a Hugging Face config): a stage too
                     trainer_state={**self.state.state_dict(), **model_record(self.model),
                                    **(trainer_state or {})})

    def load(self, path: str) -> dict[str, Any] | None:
        """Collective: resume from the newest checkpoint under ``path``, in this layout; returns
        the trainer state saved with it (None from a plain PyTorch one: left as it is)."""
        state = checkpoint.load(path, self.grad_sync, self.comm, self.placements,
                                untrained_state(self.module))
        if state is not None:
            self.state.load_state_dict(state)
        return state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated, unsharded model weights (identical on every rank for DDP; under
        expert parallelism every expert, gathered over ep)."""
        gathered = self.grad_sync.full_state_dict()
        if gathered is None and self.mesh.size("tp") > 1:
            from trainmesh.tensor_parallel.state import full_state_dict
            gathered = full_state_dict(self.module, self.comm, self.placements)
        if gathered is None:
            gathered = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.config.ep > 1:
            from trainmesh.expert_parallel.shard import gather_experts
            gathered = gather_experts(gathered, self.comm, self.placements)
        return gathered
