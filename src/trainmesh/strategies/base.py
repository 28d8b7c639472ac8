"""What a strategy declares, in one place: :class:`Strategy`.

A strategy is a way of training a layout's replicas — mesh training (DDP, ZeRO, HSDP,
offload), the parameter server, DiLoCo, fault tolerance. Its module in this package declares
its rules (rows of the axis table's kind, :class:`~trainmesh.core.axes.Rule`), the features
the generated layout matrix pairs with every axis (:class:`~trainmesh.core.axes.Feature`),
and where its gradient-sync wrapper, step policy and launcher hooks live (dotted paths,
imported only when a run needs them: this package imports nothing heavy).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from trainmesh.core.axes import Feature, Rule


@dataclass(frozen=True)
class Strategy:
    """One strategy's declaration."""

    name: str
    """Its name (``mesh``, ``ps``, ``diloco``, ``fault_tolerant``)."""
    selected_by: str
    """The flag (and value) that turns it on: ``--strategy ps``, ``--fault-tolerant``."""
    on: Callable[[Any], bool]
    """Whether a layout (a ParallelConfig) uses it."""
    rules: tuple[Rule, ...] = ()
    """What it does not combine with: rows of the table (:mod:`trainmesh.strategies.table`),
    checked with the axes' before any worker starts."""
    features: tuple[Feature, ...] = ()
    """Its settings the layout matrix pairs with every axis (tests/test_layout_matrix.py)."""
    grad_sync: str | None = None
    """``module:attribute`` of the wrapper around the engine's gradient sync (None: the mesh's
    own)."""
    policy: str | None = None
    """``module:attribute`` of its step policy (how a step's batch is split and stepped;
    None: :class:`~trainmesh.run.steps.LocalSteps`, every step once)."""
    worker: str | None = None
    """``module:attribute`` of what each of its workers runs, ``worker(cfg, device, loop)``
    with ``loop`` the one training loop (:func:`trainmesh.run.trainer._train`), for a
    strategy whose ranks are not all trainers (the parameter server's servers); None: the
    loop itself."""
    launcher: str | None = None
    """``module:attribute`` of the function that launches its local run,
    ``launcher(cfg, *, max_restarts, worker_setup, end_process_on_failure=True)``: the one
    launcher with this strategy's
    hooks (:mod:`trainmesh.run.launch`; None: the plain launch, its default hooks)."""

    def load(self, what: str) -> Any:
        """The object a dotted ``module:attribute`` field names, imported now (None if unset)."""
        path = getattr(self, what)
        if path is None:
            return None
        module, _, name = path.partition(":")
        return getattr(import_module(module), name)
