"""Activation memory: bytes kept for the backward pass, per layer, per microbatch in flight.

**Any decoder transformer** (the ``--params`` advisor) uses Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", for s sequence, b micro-batch, h hidden,
a heads, t tensor-parallel degree, 16-bit values (with dropout masks)::

    no recompute, no SP      s*b*h * (10 + 24/t + 5*a*s/(h*t))
    sequence parallel (SP)   s*b*h * (34 + 5*a*s/h) / t
    selective recompute      the 5*a*s/h attention term is dropped
    full recompute           2*s*b*h per layer (its input; /t with SP), plus one layer's full
                             activations rematerialised during its backward

fp32 training doubles these (an approximation: the 1-byte dropout masks do not double).

**The built-in GPT** (``trainmesh plan --model``) is counted from its code: pre-LN blocks, no
dropout, PyTorch's fused scaled-dot-product attention (saves q, k, v, the output and a
per-head log-sum-exp, never the s x s scores). Per block, in values of the compute dtype::

    outside TP:  ln1 input, ln1 output, ln2 input, ln2 output      4*s*b*h
                 (SP: the norms' inputs are sequence shards, 2*s*b*h/t, while the gathered
                 norm outputs the column-parallel layers keep stay whole, 2*s*b*h)
    inside TP:   q, k, v, attention output, fc output, GELU output  (4*s*b*h + 2*s*b*f)/t
    fp32 extras: LayerNorm mean/rstd 4*s*b, log-sum-exp a*s*b/t (dropped by selective recompute)

and the head keeps ln_f's input and output (2*s*b*h) and the fp32 log-softmax (s*b*V/t).

**A mixture-of-experts block** keeps the same norms and attention; its MLP's ``2*s*b*f/t`` is
replaced by what :class:`~trainmesh.models.moe.MoE` saves (whole on every TP rank), for the
``T = s*b`` tokens, top-k, E experts of width ``h_e`` and ``R`` rows this rank's experts run
(``T*k`` without expert parallelism; under ``--ep`` the rows its ep group routed to them,
``T*k`` when routing is balanced)::

    experts:   R*h_e fc output + R*h_e GELU output                   (compute dtype)
    dispatch:  R*d   the experts' input rows (each token copied k times)
    combine:   2*T*k*d the experts' outputs back in slot order and gate-weighted (what the
               scatter-add into the tokens keeps), T*k gates (compute dtype)
    routing:   T*E   router probabilities (fp32), T*k kept gate values and T their sums (fp32),
               3*T*k int64 indices (chosen experts, slot order, slot -> token)
    balance:   b*E   the per-sequence load shares (fp32)

**Pipeline in flight**: a stage holds the activations of several microbatches at its peak:
1F1B ``min(p - stage, m)`` (stage 0 holds p), GPipe ``m``, naive 1, ZB-H1 ``min(p, m)``,
interleaved ``min(2(p - r - 1) + (v - 1)p + 1, m*v)`` chunk-microbatches of 1/v stage each.
These match :func:`trainmesh.pipeline_parallel.analysis.peak_inflight_microbatches`. Without a
pipeline, gradient accumulation keeps one microbatch at a time.
"""
from __future__ import annotations

import math

RECOMPUTE = ("none", "selective", "full")


def megatron_layer_bytes(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         value_bytes: int = 2) -> float:
    """Korthikanti et al.'s per-layer activation bytes for one microbatch (see module doc)."""
    sbh = seq * batch * hidden
    scale = value_bytes / 2
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1) * scale
    attention = 5 * heads * seq / hidden if recompute == "none" else 0.0
    if sequence_parallel:
        per = (34 + attention) / tp
    else:
        per = 10 + 24 / tp + attention / tp
    return sbh * per * scale


def gpt_block_bytes(*, seq: int, batch: int, hidden: int, heads: int, ffn: int, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none",
                    value_bytes: int = 4) -> float:
    """Bytes the built-in GPT's block saves for one microbatch with no recompute/selective."""
    sb = seq * batch
    outside = (2 * sb * hidden / tp + 2 * sb * hidden) if sequence_parallel else 4 * sb * hidden
    inside = (4 * sb * hidden + 2 * sb * ffn) / tp
    stats = 4 * sb * 4 + (0 if recompute == "selective" else heads * sb / tp * 4)
    return (outside + inside) * value_bytes + stats


def moe_mlp_bytes(*, seq: int, batch: int, hidden: int, experts: int, top_k: int,
                  expert_hidden: int, value_bytes: int = 4, received: float | None = None) -> float:
    """Bytes a MoE layer saves for one microbatch in place of the dense MLP's (module doc);
    ``received``: rows this rank's experts run (None: ``T*k``, balanced routing)."""
    tokens = seq * batch
    slots = tokens * top_k
    rows = slots if received is None else received
    compute = (2 * rows * expert_hidden + rows * hidden + 2 * slots * hidden + slots) * value_bytes
    routing = 4 * tokens * experts + 4 * (slots + tokens) + 8 * 3 * slots
    return compute + routing + 4 * batch * experts


def gpt_block_input_bytes(*, seq: int, batch: int, hidden: int, tp: int = 1,
                          sequence_parallel: bool = False, value_bytes: int = 4) -> float:
    """Bytes of one block's input: all that full recompute keeps per kept layer."""
    return seq * batch * hidden * value_bytes / (tp if sequence_parallel else 1)


def gpt_head_bytes(*, seq: int, batch: int, hidden: int, vocab: int, tp: int = 1,
                   value_bytes: int = 4) -> float:
    """Bytes the built-in GPT's head saves: ln_f input and output, fp32 log-softmax of the logits."""
    sb = seq * batch
    return 2 * sb * hidden * value_bytes + sb * math.ceil(vocab / tp) * 4


def inflight_chunks(schedule: str, *, pp: int, microbatches: int, rank: int,
                    virtual_stages: int = 1) -> int:
    """Peak (chunk, microbatch) pairs holding activations on pipeline ``rank`` (see module doc)."""
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return v
    if schedule == "naive":
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    if schedule == "zb1p":
        return min(p, m)
    return min(p - rank, m)  # 1f1b


def inflight_stages(schedule: str, *, pp: int, microbatches: int, rank: int,
                    virtual_stages: int = 1) -> float:
    """Microbatches in flight on ``rank`` in units of the rank's whole set of layers."""
    return inflight_chunks(schedule, pp=pp, microbatches=microbatches, rank=rank,
                           virtual_stages=virtual_stages) / virtual_stages
