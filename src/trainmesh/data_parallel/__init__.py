"""Data parallelism over the mesh's DP axis: DDP and the ZeRO stages, behind :class:`GradSync`."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..comm import Comm
from ..config import ParallelConfig
from ..errors import ConfigError
from .base import GradSync, group_parameters, unique_named_parameters
from .ddp import DDP
from .sharded import ELEMENTWISE_OPTIMIZERS
from .zero import Zero12
from .zero3 import Zero3, find_units

SUPPORTED_ZERO = (0, 1, 2, 3)  # ZeRO stages this build runs (the CLI refuses others before launch)


def make_grad_sync(cfg: ParallelConfig, named_params: list[tuple[str, nn.Parameter]],
                   comm: Comm, *, module: nn.Module | None = None, precision: Any = None) -> GradSync:
    """The strategy for ``cfg.zero``: 0 -> DDP, 1/2 -> :class:`Zero12`, 3 -> :class:`Zero3`.

    ``precision`` (a :class:`~trainmesh.precision.Precision`) gives the dtype gradients are
    reduced in and, at ZeRO-3, the dtype parameters are gathered in; ``module`` is the model
    ZeRO-3 cuts into units.
    """
    reduce_dtype = getattr(precision, "reduce_dtype", None)
    common = dict(bucket_mb=cfg.bucket_mb, find_unused_parameters=cfg.find_unused_parameters,
                  reduce_dtype=reduce_dtype)
    if cfg.zero == 0:
        return DDP(named_params, comm, allreduce=cfg.allreduce, **common)
    if cfg.zero in (1, 2):
        return Zero12(named_params, comm, stage=cfg.zero, **common)
    if cfg.zero == 3:
        if cfg.pp > 1:
            raise ConfigError("zero", "3 cannot be combined with --pp > 1 (a stage's parameters would be "
                              "re-gathered for every pipeline microbatch); use --zero 1 or 2 with --pp")
        if module is None:
            raise ValueError("ZeRO-3 needs the module (make_grad_sync(..., module=model))")
        mixed = precision is not None and getattr(precision, "mixed", False)
        return Zero3(named_params, comm, module=module,
                     param_dtype=precision.compute_dtype if mixed else None, **common)
    raise ConfigError("zero", f"must be one of {', '.join(map(str, SUPPORTED_ZERO))}; got {cfg.zero}")


__all__ = ["DDP", "ELEMENTWISE_OPTIMIZERS", "SUPPORTED_ZERO", "GradSync", "Zero12", "Zero3",
           "find_units", "group_parameters", "make_grad_sync", "unique_named_parameters"]
