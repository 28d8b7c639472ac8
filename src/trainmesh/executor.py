"""Runs the forward and backward passes of one step's microbatches on this rank (no pipeline)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .data_parallel.base import GradSync
from .precision import Precision

LossFn = Callable[[nn.Module, Any], Any]


def as_sum_and_count(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss_fn result -> (loss_sum, token_count): a mean counts as one unit of weight."""
    if isinstance(out, tuple):
        loss_sum, count = out
        return loss_sum, torch.as_tensor(count, dtype=torch.float64)
    return out, torch.ones((), dtype=torch.float64)


class LocalExecutor:
    """Gradient accumulation over microbatches; the DP strategy reduces on the last one."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        self.model, self.loss_fn = model, loss_fn

    def run(self, microbatches: list, sync: GradSync, precision: Precision) -> tuple[float, float]:
        """Forward + backward every microbatch; returns (loss_sum, count) of this rank."""
        loss_total, count_total = 0.0, 0.0
        for i, mb in enumerate(microbatches):
            sync.before_backward(is_last=i == len(microbatches) - 1)
            with precision.autocast():
                loss_sum, count = as_sum_and_count(self.loss_fn(self.model, mb))
            precision.scale_loss(loss_sum).backward()
            loss_total += float(loss_sum.detach())
            count_total += float(count)
        return loss_total, count_total
