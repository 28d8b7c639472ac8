"""Data parallelism over a mesh group: DDP and the ZeRO stages, behind :class:`GradSync`.

Imports core, comm, config and observe; never the engine, run/ or the CLI.

One concern per file: the seam and its options (``base``), which gradients are final
(``readiness``), the bucket machinery (``buckets``), reductions in flight and their memory
(``inflight``), flat layouts (``flat``), the strategies (``ddp``, ``zero`` with ``flat_grads``,
``zero3`` with ``units``, ``zero_pipeline``, ``diloco``), what they share when sharded
(``sharded``), fp32 masters (``master``) and offload (``offload``, ``nvme``); strategies over
disjoint parameter subsets shown as one (``composite``).
:func:`make_grad_sync` composes a strategy from the configuration and the axis table
(:mod:`trainmesh.core.axes`): one per kind of parameter, over that kind's groups.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.axes import KINDS, kind_groups

from ..comm import Comm
from .base import (
    GradSync,
    SyncOptions,
    frozen_named_parameters,
    group_parameters,
    unique_named_parameters,
    untrained_state,
)
from .composite import CombinedOptimizer, CompositeSync
from .ddp import DDP
from .diloco import DiLoCo
from .sharded import ELEMENTWISE_OPTIMIZERS
from .units import find_units
from .zero import FlatZero, Zero1, Zero2
from .zero3 import Zero3
from .zero_pipeline import PipelineZero3, WOrder


def make_grad_sync(cfg: ParallelConfig, named_params: list[tuple[str, nn.Parameter]],
                   comm: Comm, *, module: nn.Module | None = None, precision: Any = None,
                   materialize: Callable[[list[tuple[str, nn.Parameter]]], None] | None = None,
                   device: Any = None, layers: list[str] | None = None,
                   kind_of: Callable[[str], str] | None = None,
                   axis: str | None = None) -> GradSync:
    """The strategy for ``cfg.zero`` over ``named_params`` (any subset of the model's
    parameters): 0 -> DDP, 1 and 2 -> :class:`FlatZero` with its stage's gradient storage, 3 ->
    :class:`Zero3` (:class:`PipelineZero3` under a pipeline). Each is built from the shared
    components (readiness, bucketer, reductions, offload).

    Its groups are the axis table's (:func:`trainmesh.core.axes.kind_groups`): parameters of each
    kind (``kind_of(name)``, "dense" for every one without it) get one strategy over their kind's
    reduce group — dense: dp x cp, or under HSDP the shard group, each reduced shard then
    all-reduced across ``dp_replicate``; experts: ``edp`` — and several kinds are composed as one
    :class:`CompositeSync`, in the table's kind order (the same on every rank). ``axis`` names
    one group for all of them instead (no replicas).

    ``precision`` (a :class:`~trainmesh.engine.precision.Precision`) gives the dtype gradients are
    reduced in and the dtype parameters are held in (ZeRO 0-2, fp32 masters with the
    optimizer) or gathered in (ZeRO-3, fp32 shards); ``module`` is the model
    ZeRO-3 cuts into units; ``materialize`` (sharded init, ZeRO-3) gives a
    unit's meta parameters their values just before the unit is sharded. ``cfg`` was validated
    when built. Under a pipeline (``cfg.pp > 1``) ZeRO-3 takes its pipeline form
    (:mod:`.zero_pipeline`); ``layers`` are then the pipeline layers this rank holds (ZeRO-3's
    units).
    """
    build = {"module": module, "precision": precision, "materialize": materialize,
             "device": device, "layers": layers}
    if axis is not None:
        return _strategy(cfg, named_params, comm, axis, None, **build)
    parts = []
    for kind in KINDS:      # the table's order: the same on every rank
        subset = [(n, p) for n, p in named_params if (kind_of(n) if kind_of else "dense") == kind]
        if not subset:      # no expert here (no ep, or a pipeline stage without MoE layers)
            continue
        own = cfg           # nvme offload: each kind's state file in its own directory
        if parts and cfg.offload_dir is not None:
            own = dataclasses.replace(cfg, offload_dir=os.path.join(cfg.offload_dir, kind))
        groups = kind_groups(comm.mesh.layout, kind)
        parts.append(_strategy(own, subset, comm, groups.reduce, groups.replicate, **build))
    if not parts:
        parts.append(_strategy(cfg, [], comm, kind_groups(comm.mesh.layout, "dense").reduce,
                               None, **build))
    split = [p for p in parts if isinstance(p, PipelineZero3) and p.w_order is not None]
    if len(split) > 1:      # zb1p: the kinds' units reduced in one order (zero_pipeline.WOrder)
        order = WOrder()
        for part in split:
            order.join(part)
    return parts[0] if len(parts) == 1 else CompositeSync(parts)


def _strategy(cfg: ParallelConfig, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
              axis: str, replicate: str | None, *, module: nn.Module | None, precision: Any,
              materialize: Callable[[list[tuple[str, nn.Parameter]]], None] | None,
              device: Any, layers: list[str] | None) -> GradSync:
    """One strategy over ``named_params``, reduced over ``axis`` (and ``replicate``)."""
    mixed = precision is not None and getattr(precision, "mixed", False)
    options = SyncOptions(bucket_mb=cfg.bucket_mb, find_unused_parameters=cfg.find_unused_parameters,
                          reduce_dtype=getattr(precision, "reduce_dtype", None),
                          param_dtype=precision.compute_dtype if mixed and cfg.zero < 3 else None,
                          device=device, offload=cfg.offload, offload_dir=cfg.offload_dir,
                          offload_params=cfg.offload_params, axis=axis,
                          replicate_axis=replicate)
    def build(opts: SyncOptions) -> GradSync:
        return _by_stage(cfg, named_params, comm, opts, module, precision, materialize, layers)
    wrap = _wrapper(cfg)   # a strategy's own around it (DiLoCo's outer step), else the mesh's
    return build(options) if wrap is None else wrap(cfg, comm, options, build)


def _wrapper(cfg: ParallelConfig) -> Callable[..., GradSync] | None:
    """The gradient-sync wrapper ``cfg``'s strategy declares (:mod:`trainmesh.strategies`):
    ``wrap(cfg, comm, options, build)``, ``build(options)`` making the mesh's strategy."""
    from trainmesh.strategies.table import strategy_of
    return strategy_of(cfg).load("grad_sync")


def _by_stage(cfg: ParallelConfig, named_params: list[tuple[str, nn.Parameter]], comm: Comm,
              options: SyncOptions, module: nn.Module | None, precision: Any,
              materialize: Callable[[list[tuple[str, nn.Parameter]]], None] | None,
              layers: list[str] | None) -> GradSync:
    """The strategy of ``cfg.zero`` with ``options`` (:func:`make_grad_sync`)."""
    mixed = precision is not None and getattr(precision, "mixed", False)
    if cfg.zero == 0:
        return DDP(named_params, comm, options, allreduce=cfg.allreduce)
    if cfg.zero in (1, 2):
        return FlatZero(named_params, comm, options, stage=cfg.zero)
    if module is None:
        raise ValueError("ZeRO-3 needs the module (make_grad_sync(..., module=model))")
    if cfg.pp > 1:
        return PipelineZero3(named_params, comm, module=module, layers=layers or [],
                             reshard=cfg.zero3_reshard,
                             param_dtype=precision.compute_dtype if mixed else None,
                             options=options, materialize=materialize,
                             split_backward=cfg.schedule == "zb1p")   # its I and W
    return Zero3(named_params, comm, module=module,
                 param_dtype=precision.compute_dtype if mixed else None, options=options,
                 materialize=materialize, units=cfg.zero3_units)


__all__ = ["DDP", "CombinedOptimizer", "CompositeSync", "DiLoCo", "ELEMENTWISE_OPTIMIZERS",
           "FlatZero", "GradSync", "PipelineZero3", "SyncOptions", "Zero1", "Zero2", "Zero3",
           "find_units", "frozen_named_parameters", "group_parameters", "make_grad_sync",
           "unique_named_parameters", "untrained_state"]
