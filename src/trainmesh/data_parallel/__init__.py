"""Data parallelism over the mesh's DP axis: DDP and the ZeRO stages, behind :class:`GradSync`."""
from __future__ import annotations

from torch import nn

from ..comm import Comm
from ..config import ParallelConfig
from ..errors import ConfigError
from .base import GradSync, group_parameters, unique_named_parameters
from .ddp import DDP


SUPPORTED_ZERO = (0,)  # ZeRO stages this build runs (the CLI refuses others before launch)


def make_grad_sync(cfg: ParallelConfig, named_params: list[tuple[str, nn.Parameter]],
                   comm: Comm, **kwargs) -> GradSync:
    """The strategy for ``cfg.zero``: 0 -> DDP."""
    if cfg.zero == 0:
        return DDP(named_params, comm, bucket_mb=cfg.bucket_mb,
                   find_unused_parameters=cfg.find_unused_parameters)
    raise ConfigError("zero", f"stage {cfg.zero} is not yet supported; valid now: 0")


__all__ = ["SUPPORTED_ZERO", "DDP", "GradSync", "group_parameters", "make_grad_sync", "unique_named_parameters"]
