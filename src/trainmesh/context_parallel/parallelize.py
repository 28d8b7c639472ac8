"""Context parallelism applied to a built model: its attention core and positions swapped.

The built-in GPT exposes two parameter-free seams (:class:`~trainmesh.models.gpt.CausalAttention`
and :class:`~trainmesh.models.gpt.Positions`); a model of one's own that uses them gets context
parallelism too. Nothing is renamed and no parameter changes: checkpoints are the same at every
cp.
"""
from __future__ import annotations

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.errors import ConfigError
from trainmesh.core.mesh import ParallelMesh
from trainmesh.models.gpt import CausalAttention, Positions
from trainmesh.models.hf_random import InstalledDraws

from .blocks import fused_available
from .documents import GatheredDocuments
from .partition import zigzag_positions
from .ring import MODES, Ring, ring_attention


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's zigzag share over the CP group's whole sequence; with
    ``position_ids`` (this rank's zigzag share of a packed batch's, (b, 2c)), within each
    document (their shares are gathered over the group once per forward by ``documents``, the
    :class:`~.documents.GatheredDocuments` the model's attention layers share, which keeps their
    plan of blocks too; None: its own)."""

    runs_collectives = True
    """Its forward exchanges K/V with the other CP ranks: ``--compile`` runs it eagerly between
    the block's graphs (:func:`trainmesh.engine.compile.compile_layers`)."""

    def __init__(self, ring: Ring, *, mode: str, fused: bool,
                 documents: GatheredDocuments | None = None) -> None:
        super().__init__()
        self.ring, self.mode, self.fused = ring, mode, fused
        self.documents = documents if documents is not None else GatheredDocuments(ring)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        docs = None if position_ids is None else self.documents(position_ids)
        return ring_attention(q, k, v, self.ring, mode=self.mode, fused=self.fused, documents=docs,
                              plans=self.documents)

    def extra_repr(self) -> str:
        return f"cp={self.ring.size}, mode={self.mode}, fused={self.fused}"


class ZigzagPositions(nn.Module):
    """The global positions of the tokens this CP rank holds (its two zigzag chunks)."""

    def __init__(self, rank: int, cp: int) -> None:
        super().__init__()
        self.rank, self.cp = rank, cp

    def forward(self, s: int, device: torch.device) -> torch.Tensor:  # -> (s,)
        return zigzag_positions(s, self.rank, self.cp, device)


def apply_context_parallel(model: nn.Module, mesh: ParallelMesh, comm: Comm, *, mode: str = "ring",
                           device: torch.device | None = None, fused: bool | None = None,
                           installed: InstalledDraws | None = None) -> int:
    """Swap every attention core and positions module of ``model`` for its context-parallel
    form over ``mesh``'s cp group, in place; returns the number of attention cores swapped.
    A Hugging Face model gets ring attention through its attention interface instead
    (:mod:`.hf_attention`: its implementation is chosen by name, no module is swapped; 0), its
    dropout drawn where ``installed`` places each attention. ``fused``: per-block fused kernels
    (None: where ``device`` has them). ConfigError naming ``--cp`` when the model has no
    attention core to swap."""
    if mode not in MODES:
        raise ConfigError("--cp-comm", f"must be one of {', '.join(MODES)}; got {mode!r}")
    from .ring import CommRing
    if fused is None:
        fused = fused_available(device or torch.device("cpu"))
    if hasattr(getattr(model, "config", None), "_attn_implementation"):   # a Hugging Face model
        from .hf_attention import apply_hf_context_parallel
        apply_hf_context_parallel(model, mesh, comm, mode=mode, fused=fused, installed=installed)
        return 0
    ring = CommRing(comm, mesh)
    documents = GatheredDocuments(ring)     # a packed forward's documents, gathered once
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, CausalAttention):
                setattr(parent, name, ContextParallelAttention(ring, mode=mode, fused=fused,
                                                                   documents=documents))
                swapped += 1
            elif isinstance(child, Positions):
                setattr(parent, name, ZigzagPositions(ring.index, ring.size))
    if not swapped:
        raise ConfigError("--cp", f"splits sequences over ranks inside the attention of the built-in "
                          f"GPT (trainmesh.models.gpt.CausalAttention); {type(model).__name__} has "
                          "none: use --cp 1")
    return swapped
