"""What a Hugging Face mixture of experts declares about its router and holds as its experts, and
its routing per sequence.

transformers records a mixture of experts' ``router_logits`` from one module class per MoE
layer (the model's ``_can_record_outputs``) and adds its router's load-balancing loss when the
config sets ``output_router_logits`` with a ``router_aux_loss_coef``. trainmesh forms that loss
per sequence (:mod:`trainmesh.models.hf_router`); the per-sequence routing it needs
(:class:`Routing`) is pooled over layers by adding, which is how the parallel packages carry it
across ranks (a pipeline stage adds its layers' to what the earlier stages sent,
:mod:`trainmesh.pipeline_parallel.hf_routing`). Its experts are recognised by what they hold
(:func:`stacked_experts`), not by their class or by the styles a plan gives them: the plans
name them differently from one transformers release to the next. Imports core only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainmesh.core.compat import in_backward
from trainmesh.core.dtypes import wide
from trainmesh.core.errors import ConfigError


def router_loss_enabled(model: nn.Module) -> bool:
    """Whether the model's config asks for its router's aux loss (``output_router_logits``,
    with a ``router_aux_loss_coef``)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False)) \
        and isinstance(getattr(config, "router_aux_loss_coef", None), (int, float))


def router_logits_of(model: nn.Module) -> tuple[type, int]:
    """(the router class transformers records ``router_logits`` from, the index of the logits
    in its output)."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    return getattr(recorder, "target_class", recorder), int(getattr(recorder, "index", 0) or 0)


def expert_count(model: nn.Module) -> int:
    """Experts per mixture-of-experts layer the model's config declares (0: none declared)."""
    config = getattr(model, "config", None)
    for attr in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def stacked_experts(model: nn.Module) -> list[str]:
    """Names of the modules holding a mixture of experts' stacked experts, in model order: a
    module (not a convolution) each of whose own parameters stacks one slice per expert along
    dimension 0 — as many as its ``num_experts``, else as its config declares — and one of them
    a matrix per expert, ``(E, out, in)`` (biases ``(E, out)`` may stand beside them). Such a
    module runs each token through the experts its routing chose, so it is per token."""
    declared = expert_count(model)
    names = []
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or isinstance(module, nn.modules.conv._ConvNd):    # (C, C_in, k): no experts
            continue
        n = getattr(module, "num_experts", None)
        n = n if isinstance(n, int) and not isinstance(n, bool) else declared
        if n > 1 and all(p.dim() >= 2 and p.shape[0] == n for p in own) \
                and any(p.dim() == 3 for p in own):
            names.append(name)
    return names


def router_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose output transformers records as ``router_logits`` (the
    routers, one per MoE layer, in model order); ConfigError naming ``--model-dir`` when the
    model records none."""
    target, _ = router_logits_of(model)
    names = [n for n, m in model.named_modules() if isinstance(target, type) and isinstance(m, target)]
    if not names:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError("--model-dir", f"{kind} asks for its router's aux loss "
                          "(output_router_logits) but records no router_logits; valid: "
                          "output_router_logits false in config.json")
    return names


@dataclass
class Routing:
    """What the aux loss needs of a forward's routing, per sequence of its ``b``: slots per
    expert (b, E), no gradient; router probability sums per expert (b, E), fp32 or wider (a
    float64 model's float64), with gradient; rows (b,), MoE layers × the sequence's tokens they
    saw here. The layers pool by adding (a pipeline stage adds its layers' to what the previous
    stages carried)."""

    slots: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    def __add__(self, other: Routing) -> Routing:
        return Routing(self.slots + other.slots, self.probs + other.probs, self.rows + other.rows)


def sequence_routing(router_logits: tuple[torch.Tensor, ...], batch: int, top_k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence of this rank's ``batch`` sequences: (slots per expert (b, E), no gradient;
    router probability sums per expert (b, E), in float32 at least (float64 logits' in float64);
    slots per expert of each layer (L, E)), the layers pooled as transformers pools them. Each logits tensor is ``(b·s, E)``."""
    slots, probs, per_layer = 0.0, 0.0, []
    for logits in router_logits:
        p = logits.to(wide(logits.dtype)).softmax(-1).view(batch, -1, logits.shape[-1])   # (b, s, E)
        chosen = p.topk(top_k, dim=-1).indices                               # (b, s, k)
        hits = torch.zeros_like(p).scatter_add_(-1, chosen, torch.ones_like(chosen, dtype=p.dtype))
        slots = slots + hits.detach().sum(1)                                  # (b, E)
        probs = probs + p.sum(1)
        per_layer.append(hits.detach().sum((0, 1)))
    return slots, probs, torch.stack(per_layer)


def layers_routing(router_logits: Sequence[torch.Tensor], layers: Sequence[int], batch: int,
                   top_k: int, counts: torch.Tensor | None) -> Routing:
    """The :class:`Routing` of the MoE layers ``layers`` (their indices among the model's
    routers) from their logits, each ``(b·s, E)`` over this rank's ``batch`` sequences; their
    per-layer slot counts added to ``counts`` (layers × experts; not again in a recomputation)."""
    slots, probs, per_layer = sequence_routing(tuple(router_logits), batch, top_k)
    tokens = router_logits[0].shape[0] // batch
    rows = torch.full((batch,), float(len(layers) * tokens), dtype=probs.dtype, device=probs.device)
    if counts is not None and not in_backward():
        counts[list(layers)] += per_layer.double().cpu()
    return Routing(slots, probs, rows)
