"""Spread each MoE layer's experts over the ``ep`` group, in place, and record what stays.

Rank ``r`` of the group keeps experts ``[r E/ep, (r + 1) E/ep)`` under their global names
(``blocks.{i}.mlp.experts.{e}.*``), drops the others (still on the meta device: never
materialised) and routes through :class:`~.dispatch.ExpertExchange`. Each kept parameter gets a
:class:`~trainmesh.core.placement.Placement` with ``expert=True``: its gradient is reduced over
``edp`` (the ranks holding the same experts) and a checkpoint writes it from one of those ranks,
whole and by its global name, so it loads under any ``--ep``.

A Hugging Face model holds a layer's experts stacked in one tensor (``(E, ...)``); its experts
are spread by :mod:`.hf` from the plan it declares, each rank keeping a run of the expert
dimension. :func:`gather_stacked` and :func:`stacked_slice` go between that run and the whole
tensor (checkpoints, consolidated weights).
"""
from __future__ import annotations

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.layout import Group
from trainmesh.core.placement import Placement, Placements
from trainmesh.models.moe import MoE

from .dispatch import ExpertExchange


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, layer) of every MoE layer of ``model``, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def expert_names(model: nn.Module) -> list[str]:
    """Names of the expert parameters ``model`` holds, in registration order."""
    prefixes = tuple(f"{name}.experts." if name else "experts." for name, _ in moe_layers(model))
    return [n for n, _ in model.named_parameters() if prefixes and n.startswith(prefixes)]


def shard_experts(model: nn.Module, comm: Comm, placements: Placements) -> None:
    """Keep this rank's experts of every MoE layer (module docstring); record their placements.
    A Hugging Face model: the experts its ``base_model_ep_plan`` names (:mod:`.hf`)."""
    from .hf import is_hf_moe, shard_hf_experts
    if is_hf_moe(model):
        shard_hf_experts(model, comm, placements)
        return
    mesh = comm.mesh
    size, index = mesh.size(Group.ep), mesh.index(Group.ep)
    for _, layer in moe_layers(model):
        local = layer.n_experts // size
        keep = range(index * local, (index + 1) * local)
        for key in list(layer.experts):
            if int(key) not in keep:
                del layer.experts[key]
        if size > 1:
            layer.exchange = ExpertExchange(comm, layer.n_experts)
    experts = set(expert_names(model))
    for name, p in model.named_parameters():
        if name in experts:
            placements.mark(name, tuple(p.shape), expert=True)


@torch.no_grad()
def gather_stacked(t: torch.Tensor, comm: Comm, placement: Placement) -> torch.Tensor:
    """The whole tensor of stacked experts ``t`` holds a run of (collective over ep: every rank
    of the group calls it for the same tensors in the same order)."""
    from trainmesh.tensor_parallel.mappings import _gather
    assert placement.ep_dim is not None
    return _gather(t.detach(), placement.ep_dim, comm, Group.ep)    # (.., E, ..): rank-major runs


def stacked_slice(full: torch.Tensor, comm: Comm, placement: Placement | None) -> torch.Tensor:
    """This rank's run of a whole tensor of stacked experts (as its placement splits it; the
    whole tensor when it is not split over ep)."""
    if placement is None or placement.ep_dim is None or full.dim() == 0:
        return full
    width = full.shape[placement.ep_dim] // comm.mesh.size(Group.ep)
    return full.narrow(placement.ep_dim, comm.mesh.index(Group.ep) * width, width).contiguous()


def gather_experts(state: dict[str, torch.Tensor], comm: Comm,
                   placements: Placements) -> dict[str, torch.Tensor]:
    """``state`` (this rank's weights by name) with every expert of its ep group added
    (collective over ep, through pickled objects: for consolidation, never in a step); stacked
    experts gathered whole, in name order."""
    state = {k: (gather_stacked(v, comm, placements.get(k)) if placements.ep_split(k) else v)
             for k, v in sorted(state.items())}
    mine = {k: v.cpu() for k, v in state.items() if placements.expert(k) and not placements.ep_split(k)}
    merged = dict(state)
    for theirs in comm.all_gather_object(mine, Group.ep):
        merged.update({k: v for k, v in theirs.items() if k not in merged})
    return merged
