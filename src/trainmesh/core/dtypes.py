"""The dtype sums and softmaxes are kept in: float32 at least, a float64 model's float64."""
from __future__ import annotations

import torch


def wide(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` in float32 at least: what sums, norms, losses and router probabilities over a
    16-bit model are computed in (its fp32 copies too); a float64 model's stay float64."""
    return torch.promote_types(dtype, torch.float32)
