"""One training step's contract between the engine and an executor.

An *executor* runs the forward and backward passes of one step's microbatches on this rank:
:class:`~trainmesh.engine.executor.LocalExecutor` (gradient accumulation) or
:class:`~trainmesh.pipeline_parallel.runtime.PipelineExecutor` (a pipeline schedule). Both
implement :class:`Executor`. The engine hands them :class:`StepHooks`: the precision policy's
autocast and loss scaling, and the two ways of telling the data-parallel strategy when a
gradient is final. So an executor knows neither the strategy nor the precision, and the engine
alone talks to both.

A step taken is reported as a value, :class:`StepReport` (what :meth:`~trainmesh.engine.engine.
Engine.apply` and the parameter server's step return; the training loop builds the step's
metrics row from it); what a data-parallel strategy adds to it (DiLoCo's ``outer``) comes from
the strategy (:meth:`~trainmesh.data_parallel.base.GradSync.step_metrics`).

``loss_fn(model, microbatch)`` returns the mean loss of the microbatch or a
``(loss_sum, token_count)`` pair (:func:`as_sum_and_count`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from trainmesh.pipeline_parallel.schedules import Timeline

LossFn = Callable[[nn.Module, Any], Any]
"""(model, microbatch) -> mean loss, or (loss_sum, token_count)."""


def as_sum_and_count(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss_fn result -> (loss_sum, token_count): a mean counts as one unit of weight."""
    if isinstance(out, tuple):
        loss_sum, count = out
        return loss_sum, torch.as_tensor(count, dtype=torch.float64)
    return out, torch.ones((), dtype=torch.float64)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of a batch or a module's output (a tensor, or dicts, lists and tuples of
    them), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


@dataclass(frozen=True)
class StepHooks:
    """What an executor calls during a step; the engine binds them to its precision policy and
    its data-parallel strategy."""

    autocast: Callable[[], AbstractContextManager[None]]
    """Context of every forward and loss: the compute dtype."""
    scale_loss: Callable[[torch.Tensor], torch.Tensor]
    """The tensor a backward starts from, given the loss sum (fp16: times the loss scale)."""
    before_backward: Callable[..., None]
    """Gradient accumulation: ``before_backward(is_last=...)`` before each microbatch's
    backward; the gradients are reduced during the last one."""
    expect_backwards: Callable[..., None]
    """Pipelines: ``expect_backwards(m, held)`` once at the start of a step, with the number of
    backward passes that run through every parameter (in any interleaving); each gradient is
    reduced after its last, except those of ``held`` (weights tied across pipeline stages),
    which wait for :attr:`release`."""
    release: Callable[[nn.Parameter], None] = lambda p: None
    """Pipelines: a gradient held back by ``expect_backwards`` is final now (summed over the
    pipeline ranks sharing its weight): the strategy reduces it as after its last backward."""
    microbatch: Callable[[int], AbstractContextManager[None]] = lambda i: nullcontext()
    """Context of every forward and backward pass of microbatch ``i`` (the step's index): where
    its elements sit in the global batch, for layout-independent randomness
    (:mod:`trainmesh.core.randomness`)."""
    backward_from: Callable[[torch.Tensor, "list[nn.Parameter] | None"], None] = lambda root, params: None
    """Called with the tensor each backward pass starts from and the parameters the pass goes
    through (None: all of this rank's; a pipeline pass: its chunk's), just before it (a split
    backward: before its ``W``, where the weight gradients appear): the strategy learns which of
    them that pass leaves without a gradient."""


class Executor(Protocol):
    """Runs one step's forward and backward passes on this rank."""

    module: nn.Module
    """The parameters this rank holds, under their names in the whole model."""
    holds_loss: bool
    """Whether this rank computes the loss (every rank without a pipeline; the last stage's)."""
    tied_parameters: list[nn.Parameter]
    """Parameters also held by another pipeline rank, their gradients summed over those ranks."""
    duplicate_parameters: list[nn.Parameter]
    """Those of them another rank counts in the gradient norm (this rank's copy is a duplicate)."""
    last_timeline: Timeline | None
    """The measured actions of the last step (this rank's row is its pipeline index; without a
    pipeline, one row of F and B per microbatch), else None."""

    def run(self, microbatches: list, hooks: StepHooks) -> tuple[float, float]:
        """Forward and backward over every microbatch; (loss_sum, token_count) of this rank."""
        ...

    def evaluate(self, microbatches: list, hooks: StepHooks) -> tuple[float, float]:
        """Forward only (no gradients, no hooks of the DP strategy's backward) over every
        microbatch; (loss_sum, token_count) of this rank, zeros where it holds no loss."""
        ...


Across = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the fault-tolerant replicas present
(:meth:`~trainmesh.engine.engine.Engine.compute`)."""


@dataclass(frozen=True)
class StepResult:
    """A computed step, not yet taken (:meth:`~trainmesh.engine.engine.Engine.compute`)."""

    loss: float
    """Mean loss over every token of the global batch."""
    grad_norm: float
    """Global gradient norm before clipping (0 where fp16 overflowed)."""
    overflow: bool
    """fp16: some gradient element overflowed; the step is skipped, the scale backs off."""
    nonfinite: str | None
    """Why the step is non-finite (never applied), or None."""
    moe: torch.Tensor | None = None
    """The MoE layers' summed counts (:meth:`~trainmesh.engine.moe_metrics.MoEMetrics.reduce`)."""


@dataclass(frozen=True)
class StepReport:
    """One step taken: its loss, gradient norm, learning rate and what the precision policy,
    the strategy, the non-finite check and the MoE layers report of it."""

    loss: float
    """Mean loss over every token of the global batch."""
    grad_norm: float | None
    """Global gradient norm before clipping; None where the strategy forms no global gradient."""
    lr: float
    """The learning rate the step used (the first parameter group's)."""
    precision: Mapping[str, Any] = field(default_factory=dict)
    """fp16's ``loss_scale`` and ``skipped`` (empty in fp32/bf16)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """What the data-parallel strategy adds (DiLoCo: ``outer`` on the steps that synchronised)."""
    nonfinite: str | None = None
    """Why the step was not applied (a non-finite loss, gradient norm or fp16 state), or None."""
    moe: Mapping[str, Any] | None = None
    """The MoE layers' aux loss and load balance of the step (MoE models only)."""

    def metrics(self) -> Mapping[str, Any]:
        """The step's fields of its metrics row, in the row's order (read-only): loss,
        grad_norm, lr, then the precision's, the strategy's (:attr:`extra`), ``nonfinite``
        and ``moe`` where they apply."""
        row: dict[str, Any] = {"loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr,
                               **self.precision, **self.extra}
        if self.nonfinite:
            row["nonfinite"] = self.nonfinite
        if self.moe is not None:
            row["moe"] = self.moe
        return MappingProxyType(row)
