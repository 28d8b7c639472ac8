"""What trainmesh keeps about a Hugging Face model it builds: one typed record beside the model.

A hub model's classes are transformers', not trainmesh's, so trainmesh sets no attribute on
them. What it learns or builds for one model lives in that model's :class:`HubState`, kept here
keyed by the model (weakly: the record goes when the model goes) and read through the accessors
below: where each axis's plan came from and why one could not be inferred
(:func:`~trainmesh.models.hf_plans.install_plans`), the function reading its weights slice by
slice (:func:`~trainmesh.engine.pretrained.from_pretrained`), and the MoE statistics its
router's aux loss fills (:mod:`trainmesh.models.hf_router`).

A model of the user's own keeps its own protocol (docs/API.md): an ``init_parameter(name,
shape, index)`` method and a ``moe_stats`` attribute it defines (the built-in GPT does both);
:func:`init_of` and :func:`moe_stats_of` read those first. Imports core only.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trainmesh.core.moe_stats import MoEStats

InitFn = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]
"""``init(name, shape, index)``: the values ``full[index]`` of parameter ``name`` of full
shape ``shape`` (the engine's sharded initialisation calls it: :mod:`trainmesh.engine.materialize`)."""


@dataclass
class HubState:
    """trainmesh's record of one Hugging Face model (module docstring)."""

    plan_sources: dict[str, str] = field(default_factory=dict)
    """Per axis (tp, pp, ep): where its plan came from: ``file``, ``declared`` or ``inferred``."""
    uninferred: dict[str, str] = field(default_factory=dict)
    """Per axis with no plan: why none could be inferred (``<module>: <why>``)."""
    init: InitFn | None = None
    """Reads ``full[index]`` of a parameter from the model directory's weights."""
    moe_stats: MoEStats | None = None
    """The router's aux loss and routing counts, for a mixture of experts whose config asks
    for its router's aux loss (created the first time it is needed)."""


_STATES: weakref.WeakKeyDictionary[nn.Module, HubState] = weakref.WeakKeyDictionary()


def _subject(model: object) -> object:
    """The model ``model`` stands for: a view of trainmesh's own names it in ``stands_for``
    (the pipeline's :class:`~trainmesh.pipeline_parallel.hf.HFPipeline`, and the last stage's
    view that ``loss_fn`` is handed, which reads its attributes through it); else ``model``."""
    inner = getattr(model, "stands_for", None)
    while inner is not None:
        model, inner = inner, getattr(inner, "stands_for", None)
    return model


def hub_state(model: object) -> HubState:
    """The record of the model ``model`` stands for, an empty one made the first time (for
    the code that fills it)."""
    subject = _subject(model)
    state = _STATES.get(subject)   # type: ignore[arg-type]
    if state is None:
        state = _STATES[subject] = HubState()   # type: ignore[index]
    return state


def recorded(model: object) -> HubState | None:
    """The record of the model ``model`` stands for, None when trainmesh keeps none (a model
    it did not build)."""
    try:
        return _STATES.get(_subject(model))   # type: ignore[arg-type]
    except TypeError:              # an object without weak references: never recorded
        return None


def init_of(model: object) -> InitFn | None:
    """The function giving ``model``'s parameters their values: its own ``init_parameter``
    method, else the weights reader trainmesh recorded for it, else None."""
    own = getattr(model, "init_parameter", None)
    if own is not None:
        return own
    state = recorded(model)
    return None if state is None else state.init


def moe_stats_of(model: object) -> MoEStats | None:
    """The MoE statistics ``model`` reports now: its own ``moe_stats`` attribute, else those
    trainmesh recorded for it (created by :func:`~trainmesh.models.hf_router.attach_router_stats`),
    else None."""
    own = getattr(model, "moe_stats", None)
    if own is not None:
        return own
    state = recorded(model)
    return None if state is None else state.moe_stats
