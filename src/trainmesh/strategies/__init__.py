"""Strategies as plug-ins: each declares its rules, features, gradient-sync wrapper, step
policy and launcher hooks in one module (:mod:`.mesh`, :mod:`.parameter_server`,
:mod:`.diloco`, :mod:`.fault_tolerant`; the declaration: :class:`.base.Strategy`), and
:mod:`.table` assembles them with the axes' into the one table of rules checked before any
worker starts. Light: importing it imports only :mod:`trainmesh.core`."""
from trainmesh.strategies.base import Strategy
from trainmesh.strategies.table import FEATURES, RULES, STRATEGIES, check, refusal, strategy_of

__all__ = ["FEATURES", "RULES", "STRATEGIES", "Strategy", "check", "refusal", "strategy_of"]
