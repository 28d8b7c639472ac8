"""Applying the layout to a model, in place, one named step per axis or feature.

:func:`parallelize` is the whole of it, in the order the steps must run (as torchtitan's
``parallelize_llama`` reads): tensor parallelism (with sequence parallelism) first, since it
replaces the layers every later step wraps; context parallelism (attention over the CP group);
expert parallelism (each rank keeps its experts); the sequence split MoE layers count over;
recomputation; compilation last, of the layers as the others left them. Each step is a no-op
where its degree is 1 or its feature off. Data parallelism is not applied to the model: the
engine's gradient-sync strategy covers the parameters these steps leave
(:func:`~trainmesh.data_parallel.make_grad_sync`).
"""
from __future__ import annotations

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.axes import sequence_groups
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.placement import Placements
from trainmesh.models.hf_random import InstalledDraws


def parallelize(model: nn.Module, cfg: ParallelConfig, *, mesh: ParallelMesh, comm: Comm,
                placements: Placements, device: torch.device,
                tp_plan: dict[str, str] | None = None,
                installed: InstalledDraws | None = None) -> nn.Module:
    """``model`` under ``cfg``'s layout on this rank, in place (module docstring); each
    parameter's place on the mesh recorded in ``placements``; ``installed``: where the
    model's drawn randomness draws (:func:`~trainmesh.models.hf_random.install_draws`).
    Returns ``model``."""
    apply_tp(model, cfg, mesh, comm, placements, tp_plan)
    apply_cp(model, cfg, mesh, comm, device, installed)
    apply_ep(model, cfg, comm, placements)
    apply_sequence_split(model, cfg, mesh, comm)
    apply_recompute(model, cfg)
    apply_compile(model, cfg, comm, device)
    return model


def apply_tp(model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh, comm: Comm,
             placements: Placements, plan: dict[str, str] | None) -> None:
    """Tensor parallelism from ``plan`` (else the model's own), with sequence parallelism."""
    if cfg.tp > 1:
        from trainmesh.tensor_parallel import parallelize as tensor_parallel
        tensor_parallel(model, mesh, comm, plan=plan, sequence_parallel=cfg.sequence_parallel,
                        placements=placements)


def apply_cp(model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh, comm: Comm,
             device: torch.device, installed: InstalledDraws | None = None) -> None:
    """Context parallelism: attention over the CP group's whole sequence, positions global
    (its dropout drawn where ``installed`` places each attention)."""
    if cfg.cp > 1:
        from trainmesh.context_parallel import apply_context_parallel
        apply_context_parallel(model, mesh, comm, mode=cfg.cp_comm, device=device,
                               installed=installed)


def apply_ep(model: nn.Module, cfg: ParallelConfig, comm: Comm, placements: Placements) -> None:
    """Expert parallelism: each ep rank keeps its share of every MoE layer's experts."""
    if cfg.ep > 1:
        from trainmesh.expert_parallel import shard_experts
        shard_experts(model, comm, placements)


def apply_sequence_split(model: nn.Module, cfg: ParallelConfig, mesh: ParallelMesh,
                         comm: Comm) -> None:
    """A sequence split over ranks (cp, sequence parallelism): MoE layers sum their
    per-sequence counts over the sequence's parts."""
    split = sequence_groups(mesh.layout, cfg.sequence_parallel)
    if split:
        from trainmesh.expert_parallel.sequence import split_sequences
        split_sequences(model, comm, split)


def apply_recompute(model: nn.Module, cfg: ParallelConfig) -> None:
    """Activation recomputation (``full`` or ``selective``) of the repeated layers."""
    if cfg.recompute != "none":
        from trainmesh.engine.recompute import apply_recompute as recompute
        recompute(model, cfg.recompute, segment=cfg.recompute_segment)


def apply_compile(model: nn.Module, cfg: ParallelConfig, comm: Comm, device: torch.device) -> None:
    """``torch.compile`` of each layer as tensor parallelism and recomputation left it."""
    if cfg.compile:
        from trainmesh.engine.compile import compile_layers
        compile_layers(model, device.type, comm, backend=cfg.compile_backend)
