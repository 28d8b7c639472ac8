"""The router's load-balancing loss of a Hugging Face mixture of experts, per sequence.

transformers adds ``router_aux_loss_coef · aux`` to a mixture of experts' loss when its config
sets ``output_router_logits``; ``aux`` is its ``load_balancing_loss_func`` (Switch Transformer):
with ``p = softmax(router logits)`` of every token of every MoE layer and each token's ``k``
largest ``p`` its chosen slots,

    aux = E · Σ_e  f_e · P_e,   f_e = slots(e) / N,   P_e = Σ p_e / N

where the counts and sums run over the MoE layers *pooled* and the ``N = L·T`` rows of the ``T``
tokens one forward holds (so ``Σ_e f_e = k``). Over the tokens of one forward, its value depends
on how the global batch is cut into ranks and microbatches. trainmesh takes the same formula
per *sequence* (``T = s``, its tokens in every MoE layer) and the mean over the global batch's
sequences, which no split changes; the training objective is

    mean cross-entropy + router_aux_loss_coef · mean over sequences of aux

(each sequence's aux weighted by its ``s`` positions and the sum divided by the global label
count, the cross-entropy's denominator: the same when every position carries a label). One
process on the whole batch forms exactly this; so does any layout.

A sequence whose tokens lie on several ranks (context parallelism, sequence parallelism) has
its per-expert slot counts and row counts summed over those ranks before the product (they carry
no gradient), while each rank keeps its own tokens' probability sums: the ranks' terms
``E · Σ_e f_e · (their Σ p_e) / N`` add up to the sequence's aux, and each one's gradient is that
rank's share (:func:`sequence_aux` takes the summing as ``split``: the engine's
:class:`~trainmesh.expert_parallel.sequence.SequenceSum` over the axis table's
``sequence_groups``, cp and, under sequence parallelism, tp, whose ranks route their own chunk
of the tokens; the statistics' ``sequence``). Under a pipeline the layers of one sequence lie on
several stages: each stage adds its layers' :class:`~trainmesh.core.hf_routing.Routing` to what the previous ones carried
and sends the sums on with the hidden states (:mod:`trainmesh.pipeline_parallel.hf_routing`);
the last stage forms the aux from them, and the gradient of the probability sums flows back
through the pipeline to every stage's routers.

Its gradient enters through :class:`~trainmesh.models.moe.AuxGrad` on the logits, so the
reported loss stays the cross-entropy and the aux is reported apart, in the model's
:class:`~trainmesh.models.moe.MoEStats`, kept in its :class:`~trainmesh.core.hub_state.HubState`
(the metrics file's ``moe``). Imports core and models.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from trainmesh.core.compat import in_backward
from trainmesh.core.hf_routing import (
    Routing,
    layers_routing,
    router_loss_enabled,
    router_modules,
)
from trainmesh.core.hub_state import hub_state, moe_stats_of

from .moe import AuxGrad, MoEStats, SequenceSplit


def attach_router_stats(model: nn.Module) -> MoEStats | None:
    """The MoE statistics ``model`` reports (:func:`~trainmesh.core.hub_state.moe_stats_of`):
    for a Hugging Face model whose config asks for the aux loss, those kept in its
    :class:`~trainmesh.core.hub_state.HubState`, created the first time; else None."""
    stats = moe_stats_of(model)
    if stats is None and router_loss_enabled(model):
        n_experts = getattr(model.config, "num_experts", None) or getattr(model.config, "num_local_experts", None) \
            or getattr(model.config, "n_routed_experts", None)
        stats = hub_state(model).moe_stats = MoEStats(len(router_modules(model)), int(n_experts))
    return stats


def record_routing(model: nn.Module, router_logits: Sequence[torch.Tensor], layers: Sequence[int],
                   batch: int) -> Routing:
    """:func:`~trainmesh.core.hf_routing.layers_routing` with the model's MoE statistics'
    counts (:func:`attach_router_stats`: created if the model has none yet)."""
    stats = attach_router_stats(model)
    return layers_routing(router_logits, layers, batch, int(model.config.num_experts_per_tok),
                          None if stats is None else stats.counts)


def sequence_aux(slots: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor,
                 split: SequenceSplit | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each sequence's aux ``E · Σ_e f_e P_e`` (b,), its rows over every rank (b,)) from this
    rank's slot counts, probability sums and ``rows`` (b,) = layers × its tokens (module
    docstring); ``split`` sums the counts and rows, in one collective, over the ranks that hold
    parts of a sequence (each rank's aux is then its share, the shares adding up to the
    sequence's)."""
    if split is not None and split.parts > 1:
        counts = torch.cat([slots, rows.unsqueeze(-1)], -1)           # (b, E + 1), no gradient
        split(counts)
        slots, rows = counts[:, :-1], counts[:, -1]
    n = rows.unsqueeze(-1)
    return slots.shape[-1] * ((slots / n) * (probs / n)).sum(-1), rows


def add_router_loss(model: nn.Module, router_logits: tuple[torch.Tensor, ...] | Routing,
                    logits: torch.Tensor) -> torch.Tensor:
    """``logits`` (b, s, vocab), carrying the gradient of ``router_aux_loss_coef`` times the
    sum over this rank's sequences of their aux, each weighted by its length (module
    docstring), from the forward's ``router_logits`` (every MoE layer's) or the
    :class:`Routing` a pipeline's stages carried; records the aux in the model's MoE statistics
    (:func:`attach_router_stats`). An evaluation (no gradient) is left as it is: nothing to
    train, nothing to report."""
    stats = attach_router_stats(model)
    if not torch.is_grad_enabled() or stats is None:
        return logits
    routing = router_logits if isinstance(router_logits, Routing) else \
        record_routing(model, router_logits, range(len(router_logits)), logits.shape[0])
    aux, whole = sequence_aux(routing.slots, routing.probs, routing.rows, stats.sequence)
    weighted = (aux * (whole / stats.n_layers)).sum()   # each sequence's aux times its length
    if not in_backward():
        stats.aux_sum += float(aux.detach().sum())           # the pooled aux, in every layer's row
        stats.sequences += float((routing.rows / whole).sum())   # this rank's share of its sequences
    return AuxGrad.apply(logits, weighted, float(model.config.router_aux_loss_coef) * stats.loss_scale)
