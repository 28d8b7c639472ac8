"""Context parallelism for Hugging Face models, through transformers' attention interface.

A Hugging Face causal LM calls attention by name (:mod:`trainmesh.models.hf_attention`).
:func:`apply_hf_context_parallel` registers trainmesh's ring (or all-gather) attention over the
CP group as an implementation and points the model at it; each CP rank holds its two zigzag
chunks of every sequence (the engine shards the batch), and:

- **positions**: a forward pre-hook on the base model passes ``position_ids`` = the global
  positions of the rank's chunks (unless the caller passes its own: a packed batch's
  ``position_ids``, sharded with the sequence, restart at every document), so the model's own
  rotary embedding (or learned positions) sees where each token sits; a padding mask
  (``attention_mask``) is refused there (the ring masks by documents and causally only);
- **attention**: the function gets the rank's q (b, h, 2c, hd) and k, v (b, h_kv, 2c, hd) after
  the rotary embedding, and attends over the whole sequence causally by chunk index
  (:func:`~.ring.ring_attention`), within each document when the caller passed position ids
  (the model hands them to the attention function; their shares are gathered over the CP group
  once per forward, the layers after the first reusing them and their plan of blocks, one
  per window: :mod:`.documents`), and within
  the layer's ``sliding_window`` (a query attends the keys less than ``window`` positions
  back, as transformers' masks); grouped-query k/v travel with their
  own head count; the model's ``scaling`` is honoured (q scaled by ``scaling·sqrt(hd)``, the
  kernels' own scale being ``1/sqrt(hd)``). The mask the model would build is not needed (none
  is built);
- **refused** (:func:`check_hf_context_parallel`, before any worker: ConfigError naming ``--cp``
  and the family): a family whose attention does not go through the interface, attention
  logit soft-capping (Gemma2), attention sinks (gpt-oss), bidirectional attention. The
  function checks the same at run time;
- **dropout**: attention dropout is drawn by (row, head, query position, key position) from the
  engine's :class:`~trainmesh.core.randomness.Draws` (:mod:`trainmesh.models.hf_random`), each
  attention module at the site and head numbering the installed draws recorded for it
  (:class:`~trainmesh.models.hf_random.InstalledDraws`, handed in by the engine), the
  positions global: each block of the ring drops what one process drops for those pairs, and
  the log-sum-exp merge keeps the normalisation over every key undropped.

Imports core, comm, models and this package.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_plan import family
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.randomness import current, keep_mask
from trainmesh.models.hf_attention import routes_attention, use_attention
from trainmesh.models.hf_random import InstalledDraws

from .documents import GatheredDocuments
from .partition import zigzag_positions
from .ring import MODES, Keep, Ring, ring_attention


def _refusal(model: nn.Module) -> str | None:
    """Why the model's attention cannot be split over cp exactly, or None."""
    config = getattr(model, "config", None)
    if not routes_attention(model):
        return "its attention does not go through transformers' attention interface"
    if not getattr(config, "is_causal", True):
        return "its attention is bidirectional"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its attention logits are soft-capped (attn_logit_softcapping)"
    if any(n.rpartition(".")[2] == "sinks" for n, _ in model.named_parameters()):
        return "its attention has sinks (a learned logit per head)"
    return None


def check_hf_context_parallel(model: nn.Module, seq_len: int | None = None) -> None:
    """Before any worker: ConfigError naming ``--cp`` and the family when the model's attention
    cannot be split over cp exactly (module docstring); ``seq_len`` limits nothing (a sliding
    window shorter than the sequence runs under cp)."""
    why = _refusal(model)
    if why is not None:
        raise ConfigError("--cp", f"the {family(model)} family cannot split its sequences over cp "
                          f"ranks: {why}; valid for it: --cp 1")


class _Positions:
    """Forward pre-hook of the base model: the global positions of the rank's zigzag chunks
    (remembered, so the attention knows the positions as its own: one document per row)."""

    def __init__(self, rank: int, cp: int) -> None:
        self.rank, self.cp = rank, cp
        self.made: torch.Tensor | None = None

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("attention_mask") is not None:
            raise ConfigError("--cp", "a padding mask (attention_mask) is not applied by ring "
                              "attention, which masks causally over whole sequences; valid: "
                              "batches without attention_mask, or --cp 1")
        if kwargs.get("position_ids") is not None:
            return args, kwargs
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        local = tokens.shape[1]
        positions = zigzag_positions(local, self.rank, self.cp, tokens.device)   # (s_local,)
        self.made = positions.unsqueeze(0)
        return args, {**kwargs, "position_ids": self.made}


class _RingAttention:
    """The attention implementation trainmesh registers: causal attention of the rank's chunks
    over the CP group's whole sequence."""

    def __init__(self, ring: Ring, mode: str, fused: bool, family: str, positions: _Positions,
                 installed: InstalledDraws) -> None:
        self.ring, self.mode, self.fused, self.family = ring, mode, fused, family
        self.positions, self.installed = positions, installed
        self.documents = GatheredDocuments(ring)      # a packed forward's, gathered once

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, *, scaling: float | None = None,
                 dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
        whole = query.shape[2] * self.ring.size
        window = kwargs.get("sliding_window")
        window = window if isinstance(window, int) and window < whole else None
        unsupported = {"softcap": kwargs.get("softcap"),
                       "s_aux": kwargs.get("s_aux"),
                       "is_causal=False": kwargs.get("is_causal") is False or None}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ConfigError("--cp", f"the {self.family} family's attention takes {bad}, which "
                              "ring attention does not compute; valid for it: --cp 1")
        head_dim = query.shape[-1]
        if scaling is not None and not math.isclose(scaling, head_dim ** -0.5):
            query = query * (scaling * math.sqrt(head_dim))     # the kernels scale by 1/sqrt(hd)
        position_ids = kwargs.get("position_ids")
        docs = None
        if position_ids is not None and position_ids is not self.positions.made:
            docs = self.documents(position_ids)                     # a packed batch's documents
        keep = _dropout(module, query, dropout, self.installed) if dropout else None
        out = ring_attention(query, key, value, self.ring, mode=self.mode, fused=self.fused,
                             documents=docs, window=window, keep=keep, plans=self.documents)
        return out.transpose(1, 2).contiguous(), None            # (b, 2c, h, hd)


def _dropout(module: nn.Module, query: torch.Tensor, p: float, installed: InstalledDraws) -> Keep:
    """Attention dropout ``p`` of the rank's queries (b, h, 2c, hd), drawn by (global row, head,
    query position, key position) at ``module``'s site in ``installed`` (module docstring)."""
    draws = current()
    if draws is None:
        raise RuntimeError("attention dropout under cp is drawn by position: run the model "
                           "through the engine (its Draws per microbatch)")
    b, h = query.shape[:2]
    rows = draws.row_ids(b)
    site, whole = installed.attention_key(module, h)
    heads = draws.split(h, whole).view(1, h, 1, 1)

    def keep(sel: slice, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        u = draws.uniform(site, rows[sel].view(-1, 1, 1, 1), heads, qpos.view(1, 1, -1, 1),
                          kpos.view(1, 1, 1, -1))
        return keep_mask(u, p)                                    # (rows, h, cq, ck)
    return keep


def apply_hf_context_parallel(model: nn.Module, mesh: ParallelMesh, comm: Comm, *, mode: str,
                              fused: bool, installed: InstalledDraws | None = None) -> None:
    """Attention over the CP group and global positions for a Hugging Face model, in place
    (module docstring); its dropout drawn where ``installed`` (the model's
    :func:`~trainmesh.models.hf_random.install_draws`) places each attention."""
    if mode not in MODES:
        raise ConfigError("--cp-comm", f"must be one of {', '.join(MODES)}; got {mode!r}")
    check_hf_context_parallel(model, None)
    from .ring import CommRing
    ring = CommRing(comm, mesh)
    name = f"trainmesh_cp_{mode}_{id(ring):x}"    # one per ring: two meshes may share a process
    positions = _Positions(ring.index, ring.size)
    use_attention(model, name, _RingAttention(ring, mode, fused, family(model), positions,
                                              installed or InstalledDraws()))
    base = getattr(model, "base_model", model)
    base.register_forward_pre_hook(positions, with_kwargs=True)
