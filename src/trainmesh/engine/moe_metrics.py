"""The MoE layers' report per step: the aux loss and the load, summed over the world.

The layers write into their model's :class:`~trainmesh.models.moe.MoEStats` (this rank's
sequences and routed slots); :meth:`MoEMetrics.reduce` adds them over every rank in one
all-reduce (TP ranks hold the same tokens: only TP index 0 contributes, unless sequence
parallelism gives each its own chunk; where a sequence is split over ranks each reports its
part of the aux loss and its share of the sequences; a pipeline stage
contributes the layers it holds) and returns the metrics file's ``"moe"`` entry:

* ``aux_loss``: the mean over MoE layers of the mean over the global batch's sequences of the
  per-sequence load-balancing loss ``E * sum_e f_e P_e`` (1.0 when balanced, E at worst), before
  the ``--moe-aux-loss`` coefficient;
* ``max_over_mean_load``: the largest, over MoE layers, of the busiest expert's routed slots over
  the mean per expert (1.0 when balanced).

The run's totals (:attr:`MoEMetrics.expert_tokens`, global; :attr:`MoEMetrics.routed`,
:attr:`MoEMetrics.received`, this rank's) go to the summary.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.layout import Group
from trainmesh.models.hf_router import attach_router_stats
from trainmesh.models.moe import MoEStats


def model_stats(model: nn.Module) -> MoEStats | None:
    """The MoE statistics ``model`` reports: the built-in GPT's ``moe_stats``, or those of a
    Hugging Face mixture of experts whose config asks for its router's aux loss (made here, kept
    in the model's :class:`~trainmesh.core.hub_state.HubState`;
    :func:`~trainmesh.engine.pretrained.causal_lm_loss` fills them)."""
    return attach_router_stats(model)


class MoEMetrics:
    """Per-step and whole-run MoE figures of one engine (module docstring)."""

    def __init__(self, stats: MoEStats | None, comm: Comm) -> None:
        self.stats, self.comm = stats, comm
        layers, experts = (stats.n_layers, stats.n_experts) if stats is not None else (0, 0)
        self.expert_tokens = torch.zeros(layers, experts, dtype=torch.float64)
        """(token, expert) slots routed to each expert of each MoE layer, over the run, global."""
        self.routed = torch.zeros(layers, experts, dtype=torch.float64)
        """The same, this rank's tokens only."""
        self.received = torch.zeros(layers, dtype=torch.float64)
        """Rows this rank's experts computed, per MoE layer, over the run."""

    def begin_step(self, loss_scale: float) -> None:
        if self.stats is not None:
            self.stats.reset()
            self.stats.loss_scale = loss_scale

    def reduce(self, *, holds: bool, across: Callable[[torch.Tensor], None] | None = None
               ) -> torch.Tensor | None:
        """Collective over the world (and ``across`` fault-tolerant replicas): the step's
        counts, aux-loss sums and sequence counts, summed; nothing recorded yet."""
        s = self.stats
        if s is None:
            return None
        flat = torch.cat([s.counts.flatten(), s.aux_sum, s.sequences])
        if not holds:
            flat.zero_()
        self.comm.all_reduce(flat, Group.world)
        if across is not None:
            across(flat)
        return flat

    def record(self, flat: torch.Tensor | None) -> dict[str, Any] | None:
        """The step is taken: add :meth:`reduce`'s totals (and this rank's own counts) to the
        run's; the step's ``"moe"`` entry."""
        s = self.stats
        if s is None or flat is None:
            return None
        self.routed += s.counts
        self.received += s.received
        n = s.n_layers * s.n_experts
        counts = flat[:n].view(s.n_layers, s.n_experts)
        aux_sum, sequences = flat[n:n + s.n_layers], flat[n + s.n_layers:]
        self.expert_tokens += counts
        load = counts.max(1).values / counts.mean(1).clamp_min(1e-12)
        return {"aux_loss": float((aux_sum / sequences.clamp_min(1)).mean()),
                "max_over_mean_load": float(load.max())}

    def summary(self) -> dict[str, Any]:
        """The summary's global ``"moe"`` entry: per-layer expert slot counts over the run."""
        return {"expert_tokens": self.expert_tokens.round().long().tolist()}
