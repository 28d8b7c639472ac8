"""Activation memory: the tensors a layer keeps for its backward, counted one by one.

One accounting serves every model the planner sees (the built-in GPT exactly; any decoder by
its shape, :class:`~.shapes.ModelShape`) and how its kernels run (:class:`Kernels`). For T
tokens on the rank (``seq * batch``, seq already divided by cp), h hidden, t = tp, q/kv the
query and key/value widths, f the MLP width, a heads, in values of the compute dtype (e bytes)
unless marked fp32, a layer with no recompute keeps::

    norm inputs        2 T h          the residual stream (/t with sequence parallelism)
    norm outputs       2 T h          the column-parallel layers' inputs, whole on every rank
                                      (a MoE block's MLP norm output: T h/t with SP)
    norm statistics    2 T n (fp32)   n = 2 (LayerNorm: mean, rstd) or 1 (RMSNorm: rstd); /t with SP
    norm fp32 copies   2 T h (fp32)   transformers' RMSNorm, written out in PyTorch ops
                                      (:attr:`Kernels.rmsnorm` ``eager``): it also keeps its input
                                      cast to fp32 and the normalised value before the weight, 4
                                      bytes a value more than a fused kernel whatever the dtype
                                      (fp32: the normalised copy; 16-bit: the fp32 input in place
                                      of the 16-bit one, plus the 16-bit normalised copy); /t with SP
    q, k, v            T (q + 2 kv)/t
    attention output   T q/t          (the output projection's input)
    log-sum-exp        T a/t (fp32)   flash/efficient kernels: all they keep besides q, k, v, out
    probabilities      T s a/t        the math kernel keeps the s x s softmax (+ with dropout a
                                      1-byte mask and the dropped copy)
    dropout masks      2 T h bytes    after the attention and the MLP (/t with SP)
    MLP                2 T f/t        fc and GELU outputs; gated (SwiGLU): 4 T f/t (gate and up
                                      outputs, the activation, the product)

With LayerNorm, a GELU MLP of 4h, the math kernel and dropout this is Korthikanti et al. 2022's
``s b h (34 + 5 a s/h)`` (16-bit); with the flash kernel and no dropout it is the built-in GPT's
count, which a test checks against the tensors autograd saves.

**A mixture-of-experts layer** replaces the MLP by what :class:`~trainmesh.models.moe.MoE`
saves for R rows its experts run (``T k`` with balanced routing): the experts' activations
(``2 R h_e``, gated ``4 R h_e``), the dispatched rows ``R h``, the combined rows ``2 T k h`` and
``T k`` gates, the routing state in fp32/int64 (``4 T E + 4 (T k + T) + 24 T k`` bytes) and the
per-sequence load shares ``4 b E``; shared experts as a dense MLP of their width. Experts are
not split by tp (expert parallelism spreads them); with sequence parallelism a rank routes its
own T/t tokens.

**Recompute.** ``selective`` recomputes the attention core (trainmesh's and Megatron's
definition, :attr:`Kernels.selective` ``"attention"``): the probabilities (math) or the
log-sum-exp (flash) are dropped. ``"op"`` is torchtitan's op-level policy: a layer keeps its
input, the outputs of every other matmul in forward order (q, v, then the MLP's first and last;
GELU MLP: q, v, fc) and the attention kernel's output and log-sum-exp; everything else is
recomputed. ``full`` keeps each layer's input (T h, /t with SP; one per segment of K layers) and
rematerialises a segment during its backward.

**Pipeline in flight**: a stage holds the activations of several microbatches at its peak:
1F1B ``min(p - stage, m)`` (stage 0 holds p), GPipe ``m``, naive 1, ZB-H1 ``min(p, m)``,
interleaved ``min(2(p - r - 1) + (v - 1)p + 1, m*v)`` chunk-microbatches of 1/v stage each.
These match :func:`trainmesh.pipeline_parallel.analysis.peak_inflight_microbatches`. Without a
pipeline, gradient accumulation keeps one microbatch at a time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from .shapes import NORM_STATS, ModelShape

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "math")
SELECTIVE = ("attention", "op")


@dataclass(frozen=True)
class Kernels:
    """How a framework runs the layer, as far as what it keeps for backward goes."""

    attention: str = "flash"
    """``flash`` (fused, keeps its output and log-sum-exp) or ``math`` (keeps the s x s softmax)."""
    selective: str = "attention"
    """What ``--recompute selective`` recomputes: ``attention`` (the attention core: trainmesh,
    Megatron) or ``op`` (torchtitan: all but every other matmul's output and the attention's)."""
    dropout: bool = False
    """Dropout after the attention and the MLP (1-byte masks; the math kernel's dropped copy)."""
    rmsnorm: str = "fused"
    """``fused`` (a kernel keeping its input and rstd: PyTorch's, Megatron's) or ``eager``
    (transformers' RMSNorm, PyTorch ops that keep an fp32 input and the normalised value too)."""

    def __post_init__(self) -> None:
        assert self.attention in ATTENTION and self.selective in SELECTIVE
        assert self.rmsnorm in ("fused", "eager")


TRAINMESH = Kernels()
"""trainmesh's own runs: PyTorch's fused attention, no dropout, attention-core selective."""


def _gpt(hidden: int, heads: int, ffn: int) -> ModelShape:
    return ModelShape(params=1, layers=1, hidden=hidden, heads=heads, ffn=ffn)


def layer_parts(model: ModelShape, kernels: Kernels = TRAINMESH, *, seq: int, batch: int,
                tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                value_bytes: int = 4, moe: bool = False, received: float | None = None
                ) -> dict[str, float]:
    """Bytes one layer keeps for one microbatch, by part (module doc); ``recompute`` none or
    selective (full keeps :func:`layer_input_bytes`). ``moe``: the layer's MLP is the mixture of
    experts; ``received``: rows this rank's experts run (None: ``T k``, balanced)."""
    assert model.hidden and model.heads
    e, t = value_bytes, tp
    tokens = seq * batch
    h, q, kv = model.hidden, model.q_dim, model.kv_dim
    sp = t if sequence_parallel else 1
    if recompute == "selective" and kernels.selective == "op":
        return _op_parts(model, tokens=tokens, tp=t, sp=sp, e=e, moe=moe)
    parts = {"norm inputs": 2 * tokens * h / sp * e,
             # the attention's input is gathered (SP); a MoE block's experts take the rank's own
             # tokens, so its MLP norm's output stays split
             "norm outputs": tokens * h * e * (1 + (1 / sp if moe else 1)),
             "norm statistics": 2 * tokens / sp * NORM_STATS[model.norm] * 4,
             **({"norm fp32 copies": 2 * tokens * h / sp * 4}
                if kernels.rmsnorm == "eager" and model.norm == "rmsnorm" else {}),
             "q, k, v": tokens * (q + 2 * kv) / t * e,
             "attention output": tokens * q / t * e}
    if recompute != "selective":
        if kernels.attention == "flash":
            parts["log-sum-exp"] = tokens * model.heads / t * 4
        else:
            per = e + (1 + e if kernels.dropout else 0)
            parts["probabilities"] = tokens * seq * model.heads / t * per
    if kernels.dropout:
        parts["dropout masks"] = 2 * tokens * h / sp
    if moe:
        parts.update(moe_parts(model, seq=seq, batch=batch, value_bytes=e, received=received,
                               tokens_per_rank=tokens // sp))
    else:
        parts["MLP"] = (4 if model.gated else 2) * tokens * model.ffn_width / t * e
    return parts


def _op_parts(model: ModelShape, *, tokens: int, tp: int, sp: int, e: int, moe: bool) -> dict[str, float]:
    """torchtitan's op-level selective recompute: the layer input, every other matmul's output
    (q, v; gated MLP: gate and down; GELU MLP: fc) and the attention output with its lse."""
    h, q, kv, f = model.hidden, model.q_dim, model.kv_dim, model.ffn_width
    assert h and model.heads
    if moe:   # the routed MLP as with no recompute; its matmul outputs are not counted apart
        mlp = sum(moe_parts(model, seq=tokens, batch=1, value_bytes=e, tokens_per_rank=tokens // sp).values())
    else:
        mlp = tokens * ((f / tp + h) if model.gated else f / tp) * e
    return {"layer input": tokens * h / sp * e, "q, v": tokens * (q + kv) / tp * e,
            "attention output": tokens * q / tp * e, "log-sum-exp": tokens * model.heads / tp * 4,
            "MLP matmul outputs": mlp}


def moe_parts(model: ModelShape, *, seq: int, batch: int, value_bytes: int = 4,
              received: float | None = None, tokens_per_rank: int | None = None) -> dict[str, float]:
    """What a mixture-of-experts MLP keeps for one microbatch (module doc), by part."""
    assert model.hidden
    e, d, k, experts = value_bytes, model.hidden, model.top_k, model.experts
    tokens = seq * batch if tokens_per_rank is None else tokens_per_rank
    slots = tokens * k
    rows = slots if received is None else received
    per_row = 4 if model.gated else 2
    parts = {"expert activations": per_row * rows * model.expert_width * e,
             "dispatched rows": rows * d * e,
             "combined rows and gates": (2 * slots * d + slots) * e,
             "routing state": 4 * tokens * experts + 4 * (slots + tokens) + 8 * 3 * slots,
             "load shares": 4 * batch * experts}
    if model.shared_ffn:
        parts["shared experts"] = per_row * tokens * model.shared_ffn * e
    return parts


def layer_bytes(model: ModelShape, kernels: Kernels = TRAINMESH, *, seq: int, batch: int,
                tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                value_bytes: int = 4, moe: bool = False, received: float | None = None) -> float:
    """Total of :func:`layer_parts` (memoised: the advisor asks for the same layers often)."""
    return _layer_total(model, kernels, seq, batch, tp, sequence_parallel, recompute, value_bytes,
                        moe, received)


@lru_cache(maxsize=65536)
def _layer_total(model: ModelShape, kernels: Kernels, seq: int, batch: int, tp: int,
                 sequence_parallel: bool, recompute: str, value_bytes: int, moe: bool,
                 received: float | None) -> float:
    return sum(layer_parts(model, kernels, seq=seq, batch=batch, tp=tp,
                           sequence_parallel=sequence_parallel, recompute=recompute,
                           value_bytes=value_bytes, moe=moe, received=received).values())


def layer_input_bytes(*, seq: int, batch: int, hidden: int, tp: int = 1,
                      sequence_parallel: bool = False, value_bytes: int = 4) -> float:
    """Bytes of one layer's input: all that full recompute keeps per kept layer."""
    return seq * batch * hidden * value_bytes / (tp if sequence_parallel else 1)


def head_parts(model: ModelShape, *, seq: int, batch: int, tp: int = 1,
               sequence_parallel: bool = False, value_bytes: int = 4) -> dict[str, float]:
    """What the final norm and the loss keep: the norm's input (/t with SP) and output, its
    statistics, and the fp32 log-softmax of the logits (``T V/t``: cross entropy in fp32)."""
    assert model.hidden and model.vocab
    tokens, sp = seq * batch, tp if sequence_parallel else 1
    return {"final norm": tokens * model.hidden * value_bytes * (1 / sp + 1)
            + tokens / sp * NORM_STATS[model.norm] * 4,
            "log-softmax (fp32)": tokens * math.ceil(model.vocab / tp) * 4}


def loss_transient_bytes(*, tokens: int, vocab: int, tp: int = 1, value_bytes: int = 4) -> float:
    """Transient memory of the loss on top of what it keeps: the larger of the forward's logits
    (and their fp32 copy under mixed precision) and the backward's two fp32 gradients of the
    log-softmax (its output's and its input's)."""
    logits = tokens * math.ceil(vocab / tp)
    forward = logits * value_bytes + (logits * 4 if value_bytes != 4 else 0)
    return max(forward, 2 * logits * 4)


# ---------------------------------------------------------------- the built-in GPT
def gpt_block_bytes(*, seq: int, batch: int, hidden: int, heads: int, ffn: int, tp: int = 1,
                    sequence_parallel: bool = False, recompute: str = "none",
                    value_bytes: int = 4) -> float:
    """Bytes the built-in GPT's block keeps for one microbatch (no recompute or selective)."""
    return layer_bytes(_gpt(hidden, heads, ffn), seq=seq, batch=batch, tp=tp,
                       sequence_parallel=sequence_parallel, recompute=recompute,
                       value_bytes=value_bytes)


def moe_mlp_bytes(*, seq: int, batch: int, hidden: int, experts: int, top_k: int,
                  expert_hidden: int, value_bytes: int = 4, received: float | None = None) -> float:
    """Bytes the built-in GPT's MoE layer keeps for one microbatch in place of the dense MLP's."""
    model = ModelShape(params=1, layers=1, hidden=hidden, heads=1, experts=experts, top_k=top_k,
                       expert_ffn=expert_hidden)
    return sum(moe_parts(model, seq=seq, batch=batch, value_bytes=value_bytes, received=received).values())


def gpt_head_bytes(*, seq: int, batch: int, hidden: int, vocab: int, tp: int = 1,
                   value_bytes: int = 4) -> float:
    """Bytes the built-in GPT's head keeps: ln_f input and output, fp32 log-softmax."""
    model = ModelShape(params=1, layers=1, hidden=hidden, heads=1, vocab=vocab)
    return sum(head_parts(model, seq=seq, batch=batch, tp=tp, value_bytes=value_bytes).values())


# ---------------------------------------------------------------- pipeline in flight
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
