"""Two data-parallel strategies in one: the dense parameters over DP, the experts over ``edp``.

Under expert parallelism the replicated (dense) parameters see every DP rank's tokens and are
reduced over ``dp``; an expert's parameters live on the ranks of one ``ep`` index and saw, through
the all-to-all, the tokens of their whole ``ep`` group: their gradients are reduced over ``edp``
(the ranks holding the same experts, dp / ep of them), and ZeRO shards their states over it
(ZeRO-3: their units are gathered and reduce-scattered over ``edp``). :class:`ExpertSplitSync`
is a :class:`~trainmesh.data_parallel.composite.CompositeSync` of one strategy of the same kind
per subset: every call goes to the dense strategy, then the expert one, on every rank.
"""
from __future__ import annotations

from trainmesh.data_parallel.base import GradSync
from trainmesh.data_parallel.composite import CombinedOptimizer, CompositeSync

__all__ = ["CombinedOptimizer", "ExpertSplitSync"]


class ExpertSplitSync(CompositeSync):
    """The dense strategy (over dp) and the expert strategy (over edp) as one (module docstring)."""

    def __init__(self, dense: GradSync, experts: GradSync) -> None:
        super().__init__([dense, experts])
        self.dense, self.experts = dense, experts
