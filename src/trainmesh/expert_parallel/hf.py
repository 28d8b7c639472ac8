"""Expert parallelism for Hugging Face mixtures of experts, from the plan the model declares.

transformers 5 declares, in ``config.base_model_ep_plan``, which parameters hold stacked experts
and which modules run them (patterns relative to the base model, ``model.``)::

    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",     # (E, 2h, d): split on dim 0
    "layers.*.mlp.experts.down_proj":    "grouped_gemm",     # (E, d, h)
    "layers.*.mlp.experts":              "ep_dispatch_experts"

(GPT-OSS adds its experts' biases, ``(E, 2h)`` and ``(E, d)``, as ``grouped_gemm``.) Both styles
are honoured here, for every family that declares them:

- ``grouped_gemm``: rank ``r`` of an ``ep`` group keeps experts ``[r E/ep, (r+1) E/ep)`` of the
  tensor — a run of its dimension 0, under the tensor's own name, recorded as a
  :class:`~trainmesh.core.placement.Placement` with ``expert=True`` (its gradient reduced over
  ``edp``) and ``ep_dim=0`` (checkpoints gather it whole over ``ep``);
- ``ep_dispatch_experts``: the experts module's ``forward(hidden_states (T, d), top_k_index
  (T, k), top_k_weights (T, k)) -> (T, d)`` is replaced by :class:`Dispatch`: the ``T·k``
  (token, expert) slots are sorted by expert and exchanged with the group by
  :class:`~.dispatch.ExpertExchange` (the built-in MoE's all-to-all), each rank runs the rows it
  received through the module's own forward (its ``num_experts`` now ``E/ep``, the rows' local
  expert ids, top-1, weight 1), the outputs return by the reverse all-to-all and each token's
  output is the gate-weighted sum of its k slots.
- an experts module taking only ``hidden_states`` (Llama 4: the tokens repeated once per
  expert, scaled by the router's scores, in expert-major blocks) is run by
  :class:`~.hf_blocks.BlockDispatch`: its non-zero rows are the chosen slots, exchanged the
  same way.

The routing is the model's own: its router, top-k, gate normalisation (Mixtral's softmax then
renormalised top-k, DeepSeek-V3's grouped sigmoid with its correction bias and scaling,
GPT-OSS's softmax over the top-k logits) run before the experts module is called, on each
rank's own tokens. What the plan does not name stays dense: routers, shared experts (Qwen2-MoE's
``shared_expert``, DeepSeek-V3's ``shared_experts``), DeepSeek-V3's first dense layers —
replicated and reduced over dp like every dense parameter. A family whose plan uses another
style, or whose experts module takes neither the routing as its arguments nor bias-free
expert-major blocks, is refused (ConfigError naming ``--ep`` and the family). Imports core and comm (and models' MoE statistics).
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from trainmesh.comm import Comm
from trainmesh.core.compat import in_backward
from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import base_name, not_inferred
from trainmesh.core.hub_state import moe_stats_of
from trainmesh.core.layout import Group
from trainmesh.core.placement import Placement, Placements
from trainmesh.models.moe import MoEStats

from .dispatch import ExpertExchange
from .hf_blocks import BlockDispatch, takes_blocks

EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")
"""The expert-parallel styles of ``base_model_ep_plan`` trainmesh honours."""


def family(model: nn.Module) -> str | None:
    """``config.model_type`` of a Hugging Face model, else None."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if isinstance(kind, str) else None


def is_hf_moe(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model (its experts spread by this module)."""
    return family(model) is not None


def _refuse(model: nn.Module, why: str) -> ConfigError:
    return ConfigError("--ep", f"{family(model)}: {why}; valid for it: --ep 1")


@dataclasses.dataclass(frozen=True)
class ExpertsLayer:
    """One ``ep_dispatch_experts`` module of the model and its stacked parameters."""

    name: str
    module: nn.Module
    n_experts: int
    stacked: tuple[str, ...]
    """Names (in the model) of its ``grouped_gemm`` parameters, split on dimension 0."""


def _prefixed(model: nn.Module, pattern: str) -> str:
    prefix = base_name(model)
    return f"{prefix}.{pattern}" if prefix else pattern


def expert_layers(model: nn.Module) -> list[ExpertsLayer]:
    """The experts modules the model's ``base_model_ep_plan`` names, in model order, each with
    its stacked parameters; ConfigError naming ``--ep`` and the family for a plan that cannot
    be honoured (none declared, another style, an experts module without ``num_experts`` or not
    taking ``(hidden_states, top_k_index, top_k_weights)`` nor bias-free expert-major blocks
    (:func:`~.hf_blocks.takes_blocks`), a parameter of it left whole, a
    stacked parameter whose first dimension is not its expert count, a split parameter outside
    the experts modules)."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None)
    if not plan:
        raise _refuse(model, "its config declares no base_model_ep_plan (the experts to spread)"
                      + not_inferred(model, "ep"))
    for pattern, style in plan.items():
        if style not in EP_STYLES:
            raise _refuse(model, f"its base_model_ep_plan gives {pattern!r} the style {style!r}, "
                          f"which trainmesh does not map (mapped: {', '.join(EP_STYLES)})")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    params = list(shapes)
    modules = dict(model.named_modules())
    split = {n for pattern, style in plan.items() if style == "grouped_gemm"
             for n in params if fnmatchcase(n, _prefixed(model, pattern))}
    layers = []
    for name, module in modules.items():
        if not name or not any(style == "ep_dispatch_experts" and fnmatchcase(name, _prefixed(model, p))
                               for p, style in plan.items()):
            continue
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or n < 1:
            raise _refuse(model, f"{name} ({type(module).__name__}) has no num_experts")
        arguments = list(inspect.signature(module.forward).parameters)
        if len(arguments) < 3 and not takes_blocks(module):
            raise _refuse(model, f"{name} ({type(module).__name__}) takes neither (hidden_states, "
                          "top_k_index, top_k_weights) nor expert-major blocks of bias-free "
                          "experts (hidden_states alone): its experts get no routing to dispatch")
        own = [f"{name}.{local}" for local, _ in module.named_parameters()]
        for full in own:
            if full not in split:
                raise _refuse(model, f"{full} is not split by its base_model_ep_plan, so each "
                              "rank would hold it whole next to a part of the experts")
            shape = shapes[full]
            if shape[0] != n:
                raise _refuse(model, f"{full} has shape {shape}, not {n} stacked experts")
        layers.append(ExpertsLayer(name, module, n, tuple(own)))
    if not layers:
        raise _refuse(model, "its base_model_ep_plan names no module of this model")
    orphans = sorted(split - {full for layer in layers for full in layer.stacked})
    if orphans:
        raise _refuse(model, f"{orphans[0]} is split by its base_model_ep_plan outside an "
                      "ep_dispatch_experts module, so no rank would get all of its tokens")
    return layers


def check_hf_ep(model: nn.Module, ep: int) -> None:
    """Before any worker starts: ``model`` (on meta is fine) can be spread over ``ep`` ranks
    from the plan it declares, and each layer's experts divide by ``ep`` (ConfigError naming
    ``--ep``)."""
    for layer in expert_layers(model):
        if layer.n_experts % ep:
            raise ConfigError("--ep", f"must divide the {layer.n_experts} experts of "
                              f"{layer.name} ({family(model)}); got {ep}")


class Dispatch:
    """The forward of one experts module under expert parallelism (module docstring): the
    slots to the ranks holding their experts, the module's own forward there, the outputs back,
    gate-weighted. ``stats()``: the model's MoE statistics, where it reports them."""

    def __init__(self, forward: Callable[..., torch.Tensor], exchange: ExpertExchange,
                 n_experts: int, local: int, index: int,
                 stats: Callable[[], MoEStats | None]) -> None:
        self.forward, self.exchange = forward, exchange
        self.n_experts, self.local, self.index, self.stats = n_experts, local, index, stats
        self.signature = inspect.signature(forward)
        """Its arguments by position or keyword (GPT-OSS names them ``router_indices``, ...)."""

    def compute(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """This rank's experts on ``rows`` grouped by local expert: the module's forward, top-1,
        weight 1 (an empty set runs one zero row and keeps none: the parameters still take part
        in backward, with zero gradient)."""
        if not rows.shape[0]:
            zero = rows.sum(0, keepdim=True)                       # (1, d), connected to rows
            ids = torch.zeros((1, 1), dtype=torch.long, device=rows.device)
            return self.forward(zero, ids, zero.new_ones((1, 1)))[:0]
        ids = torch.repeat_interleave(torch.arange(self.local, device=rows.device),
                                      torch.tensor(per_expert, device=rows.device))
        return self.forward(rows, ids.unsqueeze(-1), rows.new_ones((rows.shape[0], 1)))

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden_states, top_k_index, top_k_weights = list(
            self.signature.bind(*args, **kwargs).arguments.values())[:3]
        tokens, k = hidden_states.shape[0], top_k_index.shape[-1]   # (T, d), (T, k)
        expert_of = top_k_index.reshape(-1)                           # (T k,) slot -> expert
        order = torch.argsort(expert_of, stable=True)                 # slots sorted by expert
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        token_of = order // k                                         # sorted slot -> its token
        out, received = self.exchange(hidden_states[token_of], counts, self.compute)
        gates = top_k_weights.reshape(-1)[order].unsqueeze(-1)        # (T k, 1)
        weighted = (out * gates.to(out.dtype)).to(hidden_states.dtype)
        stats = self.stats()
        if stats is not None and torch.is_grad_enabled() and not in_backward():
            stats.received[self.index] += received
        return hidden_states.new_zeros((tokens, hidden_states.shape[-1])).index_add(0, token_of, weighted)


def shard_hf_experts(model: nn.Module, comm: Comm, placements: Placements) -> None:
    """Keep this rank's run of every layer's stacked experts and dispatch their tokens
    (module docstring); record their placements. In place."""
    size, rank = comm.mesh.size(Group.ep), comm.mesh.index(Group.ep)
    layers = expert_layers(model)
    check_hf_ep(model, size)
    if size == 1:
        return
    for index, layer in enumerate(layers):
        local = layer.n_experts // size
        start = rank * local
        for full in layer.stacked:
            owner_name, _, leaf = full.rpartition(".")
            owner = model.get_submodule(owner_name)
            p = owner._parameters[leaf]
            run = p.detach().narrow(0, start, local)                  # (E/ep, ...)
            owner._parameters[leaf] = nn.Parameter(run if p.is_meta else run.clone(),
                                                   requires_grad=p.requires_grad)
            record = placements.get(full) or Placement(full_shape=tuple(p.shape))
            placements.record(full, dataclasses.replace(record, expert=True, ep_dim=0, ep_start=start))
        layer.module.num_experts = local
        kind = BlockDispatch if takes_blocks(layer.module) else Dispatch
        layer.module.forward = kind(layer.module.forward, ExpertExchange(comm, layer.n_experts),
                                    layer.n_experts, local, index,
                                    lambda: moe_stats_of(model))
