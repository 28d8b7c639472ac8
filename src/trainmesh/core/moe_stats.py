"""What a model's mixture-of-experts layers report per step (:class:`MoEStats`), kept in core so
that every package reading it (the engine's metrics, the pipeline's routing carry, the record
trainmesh keeps of a hub model) names one type without importing the models. Imports torch only.
"""
from __future__ import annotations

from typing import Protocol

import torch


class SequenceSplit(Protocol):
    """Each sequence split over ``parts`` ranks (this rank holds ``s / parts`` of its tokens):
    ``__call__(t)`` sums ``t`` in place over those ranks (a collective, in the same order on each)."""

    parts: int

    def __call__(self, t: torch.Tensor) -> None:
        ...


class MoEStats:
    """What the MoE layers of one model report per step, and the settings the engine gives them.

    ``counts[l, e]``: (token, expert) pairs this rank routed to expert ``e`` in MoE layer ``l``
    this step (all microbatches); ``aux_sum[l]``: the sum over this rank's sequences of layer
    ``l``'s per-sequence aux loss (of its part of them, where sequences are split over ranks);
    ``sequences[l]``: how many sequences went through it (its share of them where split; 0 on
    a pipeline stage without the layer); ``received[l]``: rows this rank's experts computed (under
    expert parallelism, from every rank of its ``ep`` group). Forwards re-run in a backward
    (activation recomputation) are not counted twice."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.n_layers, self.n_experts = n_layers, n_experts
        self.loss_scale = 1.0
        """Multiplies the aux gradient (fp16's loss scale; set by the engine each step)."""
        self.sequence: SequenceSplit | None = None
        """The ranks holding the other parts of this rank's sequences, for a Hugging Face
        mixture of experts whose aux is formed over all its layers at once (set by the engine;
        the built-in GPT's layers hold their own)."""
        self.reset()

    def reset(self) -> None:
        """A new step: every count at zero."""
        self.counts = torch.zeros(self.n_layers, self.n_experts, dtype=torch.float64)
        self.aux_sum = torch.zeros(self.n_layers, dtype=torch.float64)
        self.sequences = torch.zeros(self.n_layers, dtype=torch.float64)
        self.received = torch.zeros(self.n_layers, dtype=torch.float64)
