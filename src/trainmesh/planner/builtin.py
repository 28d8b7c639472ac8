"""The built-in GPT (``trainmesh.models.gpt``) as a rank holds it under a dp x pp x tp layout.

Parameters (d model width, f = 4d MLP width, V vocabulary, S positions, L blocks), per tensor
parallel rank of t, following trainmesh's Megatron plan (``tensor_parallel.plan.gpt_plan``):

* embedding (first pipeline rank): ``embed.wte`` vocab-parallel ``V/t x d``; ``embed.wpe``
  replicated ``S x d``;
* each block: q, k, v and fc column-parallel (weights and biases split), attention ``proj`` and
  MLP ``proj`` row-parallel (weights split, biases replicated), two LayerNorms replicated:
  ``(4d^2 + 2df + 3d + f)/t + 6d``; sequence parallelism all-reduces the gradients of the 6d
  replicated norm and bias values (and of a MoE block's router and experts);
* head (last pipeline rank): ``head.ln_f`` replicated ``2d``, ``head.out`` vocab-parallel
  ``V/t x d``. With t = 1 the total is ``2Vd + Sd + L(12d^2 + 13d) + 2d``.

Mixture of experts (``n_experts`` E > 0): a MoE block's MLP, ``(2df + f)/t + d`` above, is
replaced by its router ``E d`` and the experts this rank holds, ``E/ep`` of them (``2dh + h + d``
each; both replicated over tp).

Pipeline: the runtime's cut (:func:`trainmesh.pipeline_parallel.partition.balanced_cuts`): the
ordered layers (embedding, each block, head) are cut into ``pp * v`` consecutive chunks
minimising the heaviest chunk's parameters as the rank holds them (after tp and ep); rank r
holds chunks ``r, r + pp, ...`` (round-robin, :mod:`trainmesh.pipeline_parallel.schedules`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.gpt import GPTConfig
from .shapes import ModelShape


@dataclass(frozen=True)
class RankModel:
    """The part of the GPT one pipeline/tensor rank holds."""

    blocks: int
    """Transformer blocks on this rank (all its chunks)."""
    first: bool
    """Holds the embedding (chunk 0)."""
    last: bool
    """Holds the head (last chunk)."""
    params: int
    """Parameter values this rank holds (its TP shards)."""
    tensors: int
    """Parameter tensors this rank holds."""
    partial_grad_params: int
    """Replicated values whose gradients sequence parallelism all-reduces over tp."""
    expert_params: int = 0
    """Of ``params``, the values of this rank's experts (reduced over edp, not dp)."""
    moe_blocks: int = 0
    """MoE blocks on this rank."""
    partial_dense_params: int = 0
    """Of ``partial_grad_params``, those reduced over dp (not the experts, reduced over edp)."""
    matrix_params: int = 0
    """Of ``params``, the values of the hidden weight matrices (Muon's: attention, dense MLPs,
    routers; its experts' matrices are ``expert_matrix_params``)."""
    expert_matrix_params: int = 0
    """Of ``expert_params``, the values of the experts' matrices."""


def block_params(cfg: GPTConfig, tp: int) -> int:
    d, f = cfg.d_model, cfg.d_ff
    return (4 * d * d + 2 * d * f + 3 * d + f) // tp + 6 * d


def _layer_params(cfg: GPTConfig, tp: int, ep: int) -> list[int]:
    """Parameters a rank holds of each pipeline layer: embedding, blocks, head."""
    d, vocab_rows = cfg.d_model, math.ceil(cfg.vocab_size / tp)
    moe = set(cfg.moe_blocks())
    mlp = (2 * d * cfg.d_ff + cfg.d_ff) // tp + d
    experts = cfg.n_experts // ep * cfg.expert_params() if moe else 0
    blocks = [block_params(cfg, tp) + ((cfg.n_experts * d - mlp + experts) if i in moe else 0)
              for i in range(cfg.n_layers)]
    return [vocab_rows * d + cfg.seq_len * d, *blocks, 2 * d + vocab_rows * d]


def rank_model(cfg: GPTConfig, *, pp: int, tp: int, rank: int, virtual_stages: int = 1,
               ep: int = 1) -> RankModel:
    """What pipeline ``rank`` holds, per TP shard (and, with experts, per ep rank)."""
    from ..pipeline_parallel.partition import balanced_cuts
    chunks = pp * virtual_stages
    weights = _layer_params(cfg, tp, ep)
    bounds = [0, *(balanced_cuts(weights, chunks) if chunks > 1 else []), len(weights)]
    mine = [i for c in range(rank, chunks, pp) for i in range(bounds[c], bounds[c + 1])]
    here = [i - 1 for i in mine if 0 < i <= cfg.n_layers]     # block indices
    moe = len(set(here) & set(cfg.moe_blocks()))
    local = cfg.n_experts // ep
    experts = moe * local * cfg.expert_params() if moe else 0
    first, last = 0 in mine, len(weights) - 1 in mine
    blocks = len(here)
    params = sum(weights[i] for i in mine)
    tensors = 16 * blocks + 2 * int(first) + 3 * int(last) + moe * (1 + 4 * local - 4)
    # SP: norms and row-parallel biases; a MoE block's router and experts in place of its MLP bias
    dense_partial = 6 * cfg.d_model * blocks + 2 * cfg.d_model * int(last) \
        + moe * (cfg.n_experts * cfg.d_model - cfg.d_model)
    partial = dense_partial + experts
    d, f = cfg.d_model, cfg.d_ff
    matrices = (4 * d * d * blocks + 2 * d * f * (blocks - moe)) // tp + cfg.n_experts * d * moe
    expert_matrices = moe * local * 2 * d * cfg.moe_hidden if moe else 0
    return RankModel(blocks, first, last, params, tensors, partial, experts, moe, dense_partial,
                     matrices, expert_matrices)


def gpt_shape(cfg: GPTConfig, *, micro_batch: int = 1) -> ModelShape:
    """The built-in GPT as the planner's :class:`~.shapes.ModelShape` (LayerNorm, GELU MLP of
    ``d_ff``, every ``moe_every``-th MLP a mixture of experts of width ``moe_hidden``)."""
    return ModelShape(params=cfg.num_params(), layers=cfg.n_layers, hidden=cfg.d_model,
                      heads=cfg.n_heads, seq_len=cfg.seq_len, micro_batch=micro_batch,
                      vocab=cfg.vocab_size, ffn=cfg.d_ff, experts=cfg.n_experts,
                      top_k=cfg.top_k if cfg.n_experts else 1,
                      expert_ffn=cfg.moe_hidden or None, moe_layers=len(cfg.moe_blocks()))
