"""The live state as it travels from the source to the receivers: one contiguous CPU buffer per
dtype (:func:`flatten`), cut up again on arrival (:func:`unflatten`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def state_layout(params: list[tuple[str, torch.Tensor]], optim: dict[str, dict[str, torch.Tensor]]
                 ) -> list[list[Any]]:
    """``[name, optimizer key, shape, dtype]`` per optimizer tensor, in the order they travel
    (after the parameters): the parameters' states in the parameters' order, then entries of
    names that are no parameter here (a whole-parameter optimizer's ``whole/<name>``)."""
    names = [name for name, _ in params]
    names += sorted(set(optim) - set(names))
    return [[name, k, list(t.shape), str(t.dtype).removeprefix("torch.")]
            for name in names for k, t in sorted(optim.get(name, {}).items())]


def flatten(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One contiguous CPU buffer per dtype, in the order each dtype first appears."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1).cpu())
    return [torch.cat(ts) for ts in groups.values()]


def unflatten(shapes: list[tuple[torch.Size, torch.dtype]],
               recv: Callable[[int, torch.Tensor], None]) -> list[torch.Tensor]:
    """Receive the buffers of :func:`flatten` (``recv(index, buffer)``) and cut them up."""
    order: list[torch.dtype] = []
    for _, dtype in shapes:
        if dtype not in order:
            order.append(dtype)
    pieces: dict[torch.dtype, list[torch.Tensor]] = {}
    for i, dtype in enumerate(order):
        sizes = [s.numel() for s, d in shapes if d == dtype]
        buf = torch.empty(sum(sizes), dtype=dtype)
        recv(i, buf)
        pieces[dtype] = list(torch.split(buf, sizes))
    return [pieces[dtype].pop(0).reshape(shape) for shape, dtype in shapes]
