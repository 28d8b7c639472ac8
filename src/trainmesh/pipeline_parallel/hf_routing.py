"""A Hugging Face mixture of experts' routing carried along the pipeline, for its aux loss.

The router's load-balancing loss pools every MoE layer of a sequence
(:mod:`trainmesh.models.hf_router`): ``aux = E/N² · Σ_e S_e · P_e`` with ``S`` the slots per
expert and ``P`` the router probability sums, both summed over all the layers, which the
pipeline spreads over stages. Each stage adds its own layers' :class:`~trainmesh.core.
hf_routing.Routing` (slots, probabilities, rows) per sequence to what the previous stages
carried and sends the sums on with the hidden states, as extra positions appended to them
(:func:`pack`; the next stage takes them off, :func:`unpack`); the last stage forms the aux from
the whole sums. The probabilities stay differentiable across the boundary, so the aux's
gradient ``E/N² · S_e`` reaches every stage's routers through the pipeline's own gradient
messages: no collective beyond the schedule's point-to-point ones, under every schedule.

The appended positions are ``ceil((2E + 2) / h)`` rows of the hidden width ``h``: slots, sums,
rows and the hidden states' dtype code, in fp32 or wider (the hidden states are cast up with
them where narrower, and back on the next stage), so the counts stay exact integers.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trainmesh.core.dtypes import wide
from trainmesh.core.hf_routing import Routing, layers_routing, router_logits_of, router_modules
from trainmesh.core.hub_state import moe_stats_of
from trainmesh.core.moe_stats import MoEStats

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""Hidden-state dtypes a boundary carries, by code."""


def _rows(experts: int, width: int) -> int:
    return math.ceil((2 * experts + 2) / width)


def pack(hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(b, s, h) hidden states and the routing so far -> (b, s + r, h), one boundary tensor."""
    b, _, h = hidden.shape
    dtype = wide(hidden.dtype)
    code = torch.full((b, 1), float(DTYPES.index(hidden.dtype)), dtype=dtype, device=hidden.device)
    flat = torch.cat([routing.slots.to(dtype), routing.probs.to(dtype),
                      routing.rows.to(dtype).unsqueeze(-1), code], -1)        # (b, 2E + 2)
    r = _rows(routing.slots.shape[-1], h)
    flat = torch.nn.functional.pad(flat, (0, r * h - flat.shape[-1]))
    return torch.cat([hidden.to(dtype), flat.view(b, r, h)], 1)


def unpack(x: torch.Tensor, experts: int) -> tuple[torch.Tensor, Routing]:
    """:func:`pack`'s inverse: (the hidden states in their own dtype, the routing)."""
    b, _, h = x.shape
    r = _rows(experts, h)
    flat = x[:, -r:].reshape(b, r * h)
    routing = Routing(flat[:, :experts].detach(), flat[:, experts:2 * experts],
                      flat[:, 2 * experts].detach())
    dtype = DTYPES[int(flat[0, 2 * experts + 1])]
    return x[:, :-r].to(dtype), routing


def router_stats(model: nn.Module) -> MoEStats:
    """The MoE statistics of a model whose stages carry its router's aux loss (made with the
    engine, :func:`~trainmesh.models.hf_router.attach_router_stats`)."""
    stats = moe_stats_of(model)
    assert stats is not None, "a mixture of experts asking for its aux loss has MoE statistics"
    return stats


def empty(model: nn.Module, batch: int, device: torch.device) -> Routing:
    """No layer's routing yet (the first stage's start)."""
    experts = router_stats(model).n_experts
    return Routing(torch.zeros(batch, experts, device=device),
                   torch.zeros(batch, experts, device=device), torch.zeros(batch, device=device))


class RouterTap:
    """The routers of a model's decoder layers: records the router logits of the layers a
    chunk runs (:meth:`tapped`), each router by its index among the model's routers."""

    def __init__(self, model: nn.Module, layer_names: Sequence[str]) -> None:
        self.model = model
        _, self.index = router_logits_of(model)
        routers = router_modules(model)
        self.of_layer = {layer: [(i, model.get_submodule(r)) for i, r in enumerate(routers)
                                 if r.startswith(layer + ".")] for layer in layer_names}

    @contextmanager
    def tapped(self, names: Sequence[str]) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Inside, each router of the layers ``names`` appends (its index, its logits) when
        it runs."""
        seen: list[tuple[int, torch.Tensor]] = []
        handles = []
        for name in names:
            for i, router in self.of_layer.get(name, []):
                def hook(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
                    seen.append((i, out[self.index] if isinstance(out, (tuple, list)) else out))
                handles.append(router.register_forward_hook(hook))
        try:
            yield seen
        finally:
            for h in handles:
                h.remove()

    def add(self, routing: Routing, seen: list[tuple[int, torch.Tensor]], batch: int) -> Routing:
        """``routing`` plus that of the routers ``seen`` (recording their counts)."""
        if not seen or not torch.is_grad_enabled():
            return routing
        stats = router_stats(self.model)
        return routing + layers_routing([t for _, t in seen], [i for i, _ in seen], batch,
                                        int(self.model.config.num_experts_per_tok), stats.counts)
