"""What a training step returns: :class:`StepReport`, a value.

:meth:`~trainmesh.engine.engine.Engine.apply` returns one for every step it takes (applied, or
skipped for an fp16 overflow or a non-finite value); the training loop builds the step's metrics
row from it (docs/METRICS.md), never from state the engine keeps. What a data-parallel strategy
adds to a step's metrics (DiLoCo's ``outer``) comes from the strategy
(:meth:`~trainmesh.data_parallel.base.GradSync.step_metrics`), so nothing here names one.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


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
