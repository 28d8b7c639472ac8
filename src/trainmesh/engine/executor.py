"""The executor of a rank without pipeline parallelism: gradient accumulation over microbatches.

It implements :class:`~trainmesh.core.step.Executor`, as the pipeline runtime does; see
:mod:`trainmesh.core.step` for the contract both follow.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from trainmesh.core.step import Executor, LossFn, StepHooks, as_sum_and_count
from trainmesh.pipeline_parallel.schedules import Action, TimedAction, Timeline

__all__ = ["Executor", "LocalExecutor", "LossFn", "build_executor"]


class LocalExecutor:
    """Forward and backward of every microbatch on the whole model; the DP strategy reduces the
    gradients during the last backward."""

    holds_loss = True

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        self.module, self.loss_fn = model, loss_fn
        self.tied_parameters: list[nn.Parameter] = []
        self.duplicate_parameters: list[nn.Parameter] = []
        self.last_timeline: Timeline | None = None
        """The last step's forwards and backwards as one stage's row (``--trace-out``)."""

    def run(self, microbatches: list, hooks: StepHooks) -> tuple[float, float]:
        """Forward + backward every microbatch; returns (loss_sum, count) of this rank."""
        loss_total, count_total = 0.0, 0.0
        row: list[TimedAction] = []
        for i, mb in enumerate(microbatches):
            hooks.before_backward(is_last=i == len(microbatches) - 1)
            t0 = time.perf_counter()
            with hooks.microbatch(i):
                with hooks.autocast():
                    loss_sum, count = as_sum_and_count(self.loss_fn(self.module, mb))
                t1 = time.perf_counter()
                hooks.backward_from(loss_sum, None)
                hooks.scale_loss(loss_sum).backward()
            row += [TimedAction(Action("F", 0, i), t0, t1),
                    TimedAction(Action("B", 0, i), t1, time.perf_counter())]
            loss_total += float(loss_sum.detach())
            count_total += float(count)
        self.last_timeline = Timeline([row], 1, "s", "local")
        return loss_total, count_total

    @torch.no_grad()
    def evaluate(self, microbatches: list, hooks: StepHooks) -> tuple[float, float]:
        """Forward only over every microbatch; (loss_sum, count) of this rank."""
        loss_total, count_total = 0.0, 0.0
        for i, mb in enumerate(microbatches):
            with hooks.microbatch(i), hooks.autocast():
                loss_sum, count = as_sum_and_count(self.loss_fn(self.module, mb))
            loss_total += float(loss_sum)
            count_total += float(count)
        return loss_total, count_total


def build_executor(model: nn.Module, loss_fn: LossFn, cfg, comm, device: torch.device) -> Executor:
    """This rank's share of the model and how a step runs it: all of it (:class:`LocalExecutor`)
    or its pipeline stage (a model given to the Python API whose ties the table refuses under
    this layout: :class:`~trainmesh.core.errors.ConfigError`, as before any worker of
    ``trainmesh train``)."""
    if cfg.pp == 1:
        return LocalExecutor(model, loss_fn)
    from trainmesh.core.axes import Facts
    from trainmesh.pipeline_parallel.runtime import PipelineExecutor
    from trainmesh.pipeline_parallel.schedules import build_schedule
    from trainmesh.strategies import table
    schedule = build_schedule(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    executor = PipelineExecutor(model, loss_fn, comm.mesh, comm, schedule, device=device)
    table.check_facts(cfg, Facts(ties=bool(executor.tied_parameters)))   # an API model's ties
    return executor
