"""MoE layers on sequences split over ranks: their load-balancing counts summed over the parts.

Under context parallelism a rank holds 2 of the 2·cp chunks of every sequence; under sequence
parallelism a TP rank holds 1/tp of the tokens between the tensor-parallel regions, where the
MoE layers run. The router runs on the tokens the rank holds; the per-sequence slot counts are
summed over the ranks holding the sequence's other parts (the axis table's
:func:`~trainmesh.core.axes.sequence_groups`) before the load-balancing loss is formed, so it is
the same number as in one process (:mod:`trainmesh.models.moe`; a Hugging Face mixture of
experts pools its layers per sequence, :mod:`trainmesh.models.hf_router`, and sums the same
counts over the same groups).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.hf_routing import router_loss_enabled
from trainmesh.models.hf_router import attach_router_stats

from .shard import moe_layers


class SequenceSum:
    """:class:`~trainmesh.models.moe.SequenceSplit` over the mesh groups ``axes``: one
    all-reduce per group, in that order."""

    def __init__(self, comm: Comm, axes: tuple[str, ...]) -> None:
        self.comm, self.axes = comm, axes
        self.parts = math.prod(comm.mesh.size(a) for a in axes)

    def __call__(self, t: torch.Tensor) -> None:
        for axis in self.axes:
            self.comm.all_reduce(t, axis)


def split_sequences(model: nn.Module, comm: Comm, axes: tuple[str, ...]) -> None:
    """Tell every MoE layer of ``model`` that its sequences are split over the groups ``axes``
    (a Hugging Face mixture of experts asking for its router's aux loss: its MoE statistics,
    kept beside it by trainmesh (:func:`~trainmesh.core.hub_state.moe_stats_of`), the aux being
    formed over all its layers at once)."""
    split = SequenceSum(comm, axes)
    if split.parts == 1:
        return
    for _, layer in moe_layers(model):
        layer.sequence = split
    if router_loss_enabled(model):
        stats = attach_router_stats(model)
        if stats is not None:
            stats.sequence = split
