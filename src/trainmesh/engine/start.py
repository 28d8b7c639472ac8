"""How every rank's model starts: its values, the same on every replica.

Set-up steps of the engine after the layout is applied: a model on the meta device gets this
rank's values (:func:`sharded_init`), every replica then takes the first holder's parameters
(:func:`broadcast_from_root`) and buffers (:func:`broadcast_buffers`, again before each training
forward, as DDP's ``broadcast_buffers``), and a weight tied across pipeline stages is recorded
as a duplicate on the ranks that do not count it (:func:`mark_duplicates`). Set-up traffic: the
ledger excludes it from the per-step bytes.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.axes import kind_groups
from trainmesh.core.errors import ConfigError
from trainmesh.core.placement import Placements
from trainmesh.engine.materialize import InitFn, materialize, materialize_buffers

Named = list[tuple[str, nn.Parameter]]
Fill = Callable[[Named], None]


def sharded_init(module: nn.Module, named: Named, frozen: Named, init: InitFn | None, *,
                 device: torch.device, placements: Placements, later: bool) -> Fill | None:
    """A model on the meta device: give this rank's parameters (after the tensor and pipeline
    split) their values from ``init``, or, ``later`` (ZeRO-3), leave the trainable ones to the
    strategy, unit by unit (returns the function it calls). Frozen parameters and meta buffers
    get theirs here at every stage (the same init on every rank: nothing shards them). None when
    nothing is on meta."""
    tensors = [*(p for _, p in named + frozen), *module.buffers()]
    if not any(t.is_meta for t in tensors):
        return None
    if init is None:
        raise ConfigError("model", "parameters on the meta device need an init function "
                          "(Engine(init_fn=...) or a model.init_parameter(name, shape, index))")
    fill = partial(materialize, init=init, device=device, placements=placements)
    fill(frozen)
    materialize_buffers(module, init, device)
    if not later:
        fill(named)
    return fill


@torch.no_grad()
def broadcast_from_root(named: Named, comm: Comm, placements: Placements) -> None:
    """Identical start on every replica, whatever the user's init: each parameter from the
    first of the ranks holding it (its kind's holders)."""
    mesh = comm.mesh
    if mesh.size(kind_groups(mesh.layout, "dense").holders) == 1:
        return
    for name, p in named:
        axis = kind_groups(mesh.layout, placements.kind(name)).holders
        comm.broadcast(p.data, axis, src=mesh.ranks(axis)[0])


@torch.no_grad()
def broadcast_buffers(module: nn.Module, comm: Comm, axis: str) -> None:
    """Every floating or integer buffer (BatchNorm statistics, counters) from the root of
    ``axis``, as DDP's ``broadcast_buffers``; one collective per buffer, in registration order."""
    root = comm.mesh.ranks(axis)[0]
    for _, b in module.named_buffers():
        if b.numel() and not b.is_meta:
            comm.broadcast(b.data, axis, src=root)


def keep_buffers_in_step(module: nn.Module, comm: Comm, axis: str) -> None:
    """Buffers from the root now and before every training forward (evaluation keeps its own)."""
    broadcast_buffers(module, comm, axis)

    def before_forward(_module: nn.Module, _args: object) -> None:
        if torch.is_grad_enabled():
            broadcast_buffers(module, comm, axis)
    module.register_forward_pre_hook(before_forward)


def mark_duplicates(named: Named, duplicates: list[nn.Parameter], placements: Placements) -> None:
    """Pipeline ties held on several ranks: record this rank's copy as a duplicate."""
    ids = {id(p) for p in duplicates}
    for name, p in named:
        if id(p) in ids:
            placements.mark(name, tuple(p.shape), duplicate=True)
