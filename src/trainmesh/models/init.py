"""Initial weights as a function of (seed, parameter name, row) alone.

Whatever the layout, a parameter's full initial value is the same tensor, and any slice of it
can be built without the rest: row ``i`` of a parameter (viewed as ``(shape[0], -1)``) is
drawn from a generator seeded by ``(seed, name, i)``. So a tensor-parallel rank builds only
its rows or columns, a pipeline stage only its layers, a ZeRO-3 rank one unit at a time, and
every layout starts from the slices of the one-process model.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
from torch import nn

from trainmesh.core.compat import materialize_empty


def _seed(seed: int, name: str, row: int) -> int:
    """The seed of row ``row`` of parameter ``name``."""
    return (seed * 1_000_003 + zlib.crc32(f"{name}#{row}".encode())) % 2**63


def full_index(index: Sequence[slice] | None, shape: tuple[int, ...]) -> tuple[range, ...]:
    """``index`` (slices, missing trailing dims whole) as one ``range`` per dimension."""
    index = tuple(index or ())
    index += (slice(None),) * (len(shape) - len(index))
    return tuple(range(*s.indices(n)) for s, n in zip(index, shape))


def init_value(name: str, shape: tuple[int, ...], *, seed: int, n_layers: int, std: float = 0.02,
               index: Sequence[slice] | None = None) -> torch.Tensor:
    """fp32 ``full[index]`` of parameter ``name``'s initial value (GPT-2 style rules, by name);
    ``index=None``: the whole. Costs the slice's rows, never the whole parameter."""
    ranges = full_index(index, shape)
    out_shape = tuple(len(r) for r in ranges)
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if owner.startswith("ln") or "norm" in owner:
        return torch.ones(out_shape) if leaf == "weight" else torch.zeros(out_shape)
    if leaf == "bias":
        return torch.zeros(out_shape)
    if name.endswith("proj.weight"):  # residual projections, scaled by depth
        std = std / math.sqrt(2 * n_layers)
    if not shape:
        return torch.randn((), generator=torch.Generator().manual_seed(_seed(seed, name, 0))) * std
    rest = shape[1:]
    cols = tuple(slice(r.start, r.stop, r.step) for r in ranges[1:])
    whole_rows = out_shape[1:] == rest
    out = torch.empty(out_shape)
    gen = torch.Generator()
    for j, i in enumerate(ranges[0]):                      # one row at a time: (rest,) -> slice
        gen.manual_seed(_seed(seed, name, i))
        if whole_rows:
            torch.randn(rest, generator=gen, out=out[j])
        else:
            out[j] = torch.randn(rest, generator=gen)[cols]
    return out.mul_(std)


@torch.no_grad()
def init_module(module: nn.Module, *, seed: int, n_layers: int, prefix: str = "") -> None:
    """Materialise (if on meta) and initialise every parameter of ``module`` by its full name."""
    if any(p.is_meta for p in module.parameters()):
        materialize_empty(module)
    for name, p in module.named_parameters(prefix=prefix.rstrip(".")):
        p.copy_(init_value(name, tuple(p.shape), seed=seed, n_layers=n_layers).to(p.dtype))
