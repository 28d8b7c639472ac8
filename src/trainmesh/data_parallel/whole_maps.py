"""Which map of whole matrices each optimizer that needs them gets, by the part of the layout
it steps: ZeRO's owners, tp's owners, by name, or its own matrices (:mod:`.muon_owners`,
:mod:`.zero_owners`)."""
from __future__ import annotations

from trainmesh.core.placement import Placements

from ..comm import Comm
from .base import GradSync
from .composite import CompositeSync
from .muon import MuonAdamW
from .muon_owners import ByName, TensorParallel, TensorParallelOwners
from .sharded import ShardedSync
from .zero_owners import ShardOwners


def install(sync: GradSync, comm: Comm, placements: Placements | None) -> None:
    """Give every optimizer that declares ``needs_whole_params`` (and takes a ``wholes`` map:
    :class:`~.muon.MuonAdamW`, :class:`~.muon.WholeParams`) the map its part of the layout
    needs (:mod:`.muon_owners`' docstring)."""
    parts = sync.parts if isinstance(sync, CompositeSync) else [sync]
    tp = TensorParallel(comm, placements)
    for part in parts:
        opt = part.optimizer
        if opt is None or not getattr(opt, "needs_whole_params", False) or not hasattr(opt, "wholes"):
            continue
        muon = isinstance(opt, MuonAdamW)
        if isinstance(part, ShardedSync):
            opt.wholes = ShardOwners(part, tp, tp_owned=muon)
        elif tp.tp > 1 and muon:
            opt.wholes = TensorParallelOwners(part, tp)
        elif tp.tp > 1 or hasattr(opt, "whole_state"):   # a user's optimizer: states by name
            opt.wholes = ByName(part, tp)
