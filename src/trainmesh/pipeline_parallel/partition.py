"""Cutting an ordered layer list into pipeline stages.

A pipelined model is an ordered list of layers (``model.pipeline_layers()`` for the built-in GPT:
embedding, each block, final norm + head; or an ``nn.Sequential`` / list of modules). The list is
cut into ``pp * v`` consecutive stages; rank ``r`` holds stages ``r, r+pp, ...`` (round-robin,
see :meth:`.schedules.Schedule.stages_of_rank`). The first stage always starts with the first
layer (the embedding) and the last ends with the last layer (the head; the loss runs after it).

By default the cut balances the parameter count: it minimises the largest stage (the classic
linear-partition problem, solved exactly). Explicit cuts are a list of ``pp*v - 1`` strictly
increasing layer indices, each the first layer of a stage after the first.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from torch import nn

from trainmesh.core.errors import ConfigError

NamedLayer = tuple[str, nn.Module]
"""A layer and its qualified name inside the full model (``"blocks.3"``), used as a prefix."""


def named_pipeline_layers(model: nn.Module | Sequence[nn.Module]) -> list[NamedLayer]:
    """The model's ordered layers with their names in the full model.

    Accepts a module with ``pipeline_layers()`` (the reference GPT), an ``nn.Sequential`` or a
    list/tuple of modules; anything else raises :class:`ConfigError` saying what is needed.
    """
    if isinstance(model, (list, tuple)):
        layers, root = list(model), None
    elif hasattr(model, "pipeline_layers"):
        layers, root = list(model.pipeline_layers()), model
    elif isinstance(model, nn.Sequential):
        layers, root = list(model), model
    else:
        raise ConfigError("pp", f"pipeline parallelism needs the model as an ordered list of layers: "
                                f"a module with pipeline_layers(), an nn.Sequential or a list of "
                                f"modules; got {type(model).__name__}")
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise ConfigError("pp", "pipeline_layers() must return a non-empty list of nn.Module")
    if root is None:
        return [(str(i), layer) for i, layer in enumerate(layers)]
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False) if n}
    missing = [i for i, layer in enumerate(layers) if id(layer) not in names]
    if missing:
        raise ConfigError("pp", f"pipeline layer(s) {missing} are not submodules of the model, "
                                "so their parameters have no names")
    return [(names[id(layer)], layer) for layer in layers]


def param_count(layer: nn.Module) -> int:
    """Elements of the layer's parameters (each shared parameter once)."""
    return sum(p.numel() for p in {id(p): p for p in layer.parameters()}.values())


def balanced_cuts(weights: Sequence[int], num_stages: int) -> list[int]:
    """Cut points minimising the heaviest stage: ``num_stages - 1`` first-layer indices.

    Exact dynamic programme over (layers placed, stages used); ties go to the earliest cut, so
    the result is deterministic (every rank computes the same partition).
    """
    n = len(weights)
    check_stage_count(n, num_stages)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + max(int(w), 0))

    @lru_cache(maxsize=None)
    def best(start: int, stages: int) -> tuple[int, tuple[int, ...]]:
        """(heaviest stage, cuts) for layers ``start..n-1`` in ``stages`` stages."""
        if stages == 1:
            return prefix[n] - prefix[start], ()
        result: tuple[int, tuple[int, ...]] | None = None
        for end in range(start + 1, n - stages + 2):  # first stage = layers start..end-1
            rest, cuts = best(end, stages - 1)
            cost = max(prefix[end] - prefix[start], rest)
            if result is None or cost < result[0]:
                result = (cost, (end, *cuts))
        assert result is not None
        return result

    return list(best(0, num_stages)[1])


def check_stage_count(num_layers: int, num_stages: int) -> None:
    """Every stage needs at least one layer."""
    if num_layers < num_stages:
        raise ConfigError("pp", f"pp x virtual-stages = {num_stages} stages need at least "
                                f"{num_stages} pipeline layers; the model has {num_layers} "
                                "(use a smaller --pp / --virtual-stages or more --layers)")


def check_cuts(cuts: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate explicit cut points (first layer of every stage after the first)."""
    cuts = [int(c) for c in cuts]
    ok = (len(cuts) == num_stages - 1 and all(0 < c < num_layers for c in cuts)
          and all(a < b for a, b in zip(cuts, cuts[1:])))
    if not ok:
        raise ConfigError("pp", f"pipeline cuts must be {num_stages - 1} strictly increasing layer "
                                f"indices in 1..{num_layers - 1} (first layer of each stage after "
                                f"the first); got {cuts}")
    return cuts


def partition(layers: Sequence[NamedLayer], num_stages: int,
              cuts: Sequence[int] | None = None) -> list[list[NamedLayer]]:
    """Split ``layers`` into ``num_stages`` consecutive, non-empty stages.

    ``cuts`` gives the first layer index of each stage after the first; without it the stages
    are balanced by parameter count (:func:`balanced_cuts`).
    """
    check_stage_count(len(layers), num_stages)
    if cuts is None:
        cuts = balanced_cuts([param_count(m) for _, m in layers], num_stages)
    else:
        cuts = check_cuts(cuts, len(layers), num_stages)
    bounds = [0, *cuts, len(layers)]
    return [list(layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def shared_stages(stages: Sequence[Sequence[NamedLayer]]) -> list[tuple[nn.Parameter, list[int]]]:
    """Each parameter held by layers of several stages, with those stages (ascending)."""
    owners: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for s, stage in enumerate(stages):
        for _, layer in stage:
            for p in layer.parameters():
                owners.setdefault(id(p), (p, set()))[1].add(s)
    return [(p, sorted(ss)) for p, ss in owners.values() if len(ss) > 1]


def ties_on_one_rank(shared: Sequence[tuple[nn.Parameter, list[int]]], pp: int) -> bool:
    """Whether a shared parameter's stages include two that one rank holds (rank = stage mod
    pp): the fact the table's rule on it reads (:class:`~trainmesh.core.axes.Facts`)."""
    return any(len({s % pp for s in ss}) < len(ss) for _, ss in shared)

