"""Initial weights as a function of (seed, parameter name) alone.

Whatever the layout, a parameter's full initial value is the same tensor: a rank that holds a
shard builds the full value and slices it (or builds only its layers), so every layout starts
from the same logical model.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def init_value(name: str, shape: tuple[int, ...], *, seed: int, n_layers: int,
               std: float = 0.02) -> torch.Tensor:
    """The full fp32 initial value of parameter ``name`` (GPT-2 style rules, by name)."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if owner.startswith("ln") or "norm" in owner:
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    if name.endswith("proj.weight"):  # residual projections, scaled by depth
        std = std / math.sqrt(2 * n_layers)
    return torch.randn(shape, generator=_generator(seed, name)) * std


@torch.no_grad()
def init_module(module: nn.Module, *, seed: int, n_layers: int, prefix: str = "") -> None:
    """Materialise (if on meta) and initialise every parameter of ``module`` by its full name."""
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device="cpu")
    for name, p in module.named_parameters(prefix=prefix.rstrip(".")):
        p.copy_(init_value(name, tuple(p.shape), seed=seed, n_layers=n_layers).to(p.dtype))
