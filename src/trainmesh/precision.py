"""Precision policy: compute dtype, loss scaling and the overflow check."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .config import ParallelConfig
from .errors import ConfigError


class Precision:
    """fp32 training: no casting, no loss scaling."""

    def __init__(self, cfg: ParallelConfig, device: torch.device) -> None:
        if cfg.precision != "fp32":
            raise ConfigError("precision", f"{cfg.precision} is not yet supported; valid now: fp32")
        self.cfg = cfg
        self.device = device
        self.compute_dtype = torch.float32
        self.loss_scale = 1.0

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.loss_scale != 1.0 else loss

    def should_skip(self, grads_finite: torch.Tensor, all_reduce_min) -> bool:
        """Whether every rank skips this step (always False in fp32)."""
        return False

    def metrics(self) -> dict:
        return {}
