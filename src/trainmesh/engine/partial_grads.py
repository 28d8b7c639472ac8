"""What sequence parallelism and tensor parallelism change in a step's gradients and norm.

Under sequence parallelism each TP rank runs the replicated parameters of the layers between the
tensor-parallel regions on its own chunk of every sequence: its gradient is a part, summed over
tp (the axis table's ``LATER["partial_grad"]``), and whether a parameter was used at all is
agreed over tp too (an expert no token of one rank's chunk chose may be chosen in another's).
The global norm counts each logical parameter once: a tp shard on every TP rank, a replicated
parameter on the first, a pipeline tie's duplicate nowhere.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.axes import LATER
from trainmesh.core.layout import Group
from trainmesh.core.placement import Placements
from trainmesh.core.step import Across


def counted_in_norm(placements: Placements, tp_index: int) -> Callable[[str, nn.Parameter], bool]:
    """Whether this rank (``tp_index`` in its TP group) counts a parameter in the global norm:
    duplicates only once (``LATER``), a tp shard on every TP rank, a replicated one on the first."""
    def counted(name: str, _p: nn.Parameter) -> bool:
        placement = placements.get(name)
        if placement is not None and placement.duplicate and not LATER["duplicate"].counted:
            return False
        return (placement is not None and placement.sharded) or tp_index == 0
    return counted


def split_over_tp(placements: Placements, comm: Comm) -> bool:
    """Whether some replicated parameter's gradient is a part to be summed over tp."""
    return bool(placements.partial_grad_names()) and comm.mesh.size(Group.tp) > 1


def unused_reach(placements: Placements, comm: Comm, across: Across | None) -> Across | None:
    """The unused check's reach: over tp too where parameters run on sequence chunks (one used
    by any TP rank is updated on each, its gradient summed over tp, a zero part from the ranks
    that did not use it); then ``across``, the fault-tolerant replicas present."""
    if not split_over_tp(placements, comm):
        return across

    def over_tp(flags: torch.Tensor) -> None:
        comm.all_reduce(flags, LATER["partial_grad"].then)
        if across is not None:
            across(flags)
    return over_tp


def complete_partial_grads(placements: Placements, comm: Comm, grads_of) -> None:
    """Sum the partial gradients over tp, by name order, in one flat all-reduce: after the DP
    reduction (both are sums, so they commute), on whatever holds the reduced gradient (whole
    gradients, or under ZeRO-2/3 this rank's pieces of the gradient shard: the same pieces on
    every rank of a TP group). ``grads_of(names)``: the strategy's."""
    if split_over_tp(placements, comm):
        from trainmesh.tensor_parallel.state import sum_partial_grads
        sum_partial_grads(grads_of(placements.partial_grad_names()), comm, LATER["partial_grad"].then)
