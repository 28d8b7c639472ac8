"""THE table: the axes' rules and features (:mod:`trainmesh.core.axes`) and every strategy's
(:data:`STRATEGIES`), checked as one before any worker starts.

``ParallelConfig`` checks the rules on the layout alone, ``TrainConfig`` again with the facts
of the model and the run (:class:`~trainmesh.core.axes.Facts`: experts, layers, tied weights,
a hub model, checkpoints), the pipeline runtime the one fact only it sees for models given to
the Python API. Each refusal is an exit 2 naming its flag; tests/test_layout_matrix.py turns
every row into a refusal case and pairs every feature no rule refuses.
"""
from __future__ import annotations

from typing import Any

from trainmesh.core import axes
from trainmesh.core.axes import Facts, Feature, Refusal, Rule
from trainmesh.strategies import diloco, fault_tolerant, mesh, parameter_server
from trainmesh.strategies.base import Strategy

STRATEGIES: tuple[Strategy, ...] = (mesh.STRATEGY, parameter_server.STRATEGY, diloco.STRATEGY,
                                    fault_tolerant.STRATEGY)
"""Every strategy, in the order their rules are checked."""

RULES: tuple[Rule, ...] = (*axes.RULES, *(r for s in STRATEGIES for r in s.rules))
"""Every rule: the axes', then each strategy's."""

FEATURES: tuple[Feature, ...] = (*axes.FEATURES, *(f for s in STRATEGIES for f in s.features))
"""Every feature the layout matrix pairs: the axes', then each strategy's."""


def refusal(cfg: Any, facts: Facts | None = None) -> Refusal | None:
    """The first rule of the table ``cfg`` breaks with ``facts`` (unknown facts: the rules
    that need them skipped), or None."""
    return axes.refusal(cfg, facts=facts, rules=RULES)


def check(cfg: Any, facts: Facts | None = None) -> None:
    """Raise the :class:`~trainmesh.core.errors.ConfigError` of the first rule ``cfg`` breaks."""
    axes.check(cfg, facts=facts, rules=RULES)


def check_facts(cfg: Any, facts: Facts) -> None:
    """Only the rules that read a fact given in ``facts`` (and no other unknown one): where a
    fact is learnt late (the pipeline runtime's cut of a model given to the Python API);
    ``cfg`` needs only the fields those rules read."""
    given = {n for n in Facts.__dataclass_fields__ if getattr(facts, n) is not None}
    for rule in RULES:
        if rule.needs and set(rule.needs) <= given and rule.refuses(cfg, facts):
            raise rule.refusal(cfg, facts).error()


def strategy_of(cfg: Any) -> Strategy:
    """The strategy a layout trains with (fault tolerance wraps mesh training: its own)."""
    if cfg.fault_tolerant:
        return fault_tolerant.STRATEGY
    return next(s for s in STRATEGIES if s.name == cfg.strategy)
