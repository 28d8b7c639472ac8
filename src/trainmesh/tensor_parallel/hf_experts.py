"""Tensor parallelism of Hugging Face stacked experts, from the styles the model declares.

Up to transformers 5.24, the ``base_model_tp_plan`` of a mixture of experts (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) names the stacked expert *parameters* and the experts
*module*::

    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",   # (E, 2h, d)
    "layers.*.mlp.experts.down_proj":    "rowwise",          # (E, d, h)
    "layers.*.mlp.experts":              "moe_tp_experts"

Every rank keeps a slice of every expert, as a Megatron MLP is split:

===================================  =====================================================
``packed_colwise`` (a 3-D parameter)  dimension 1 holds gate then up: each half split over tp
                                      (``tp_dim=1``, ``tp_parts=2``); on an ``nn.Linear`` it is
                                      the module style ``colwise_parts:2`` (:mod:`.hf`)
``packed_rowwise`` (a 3-D parameter)  dimension 2 holds gate then up, the experts stored
                                      ``(E, in, out)`` (Llama 4's ``gate_up_proj``, multiplied
                                      as ``x @ W``): each half split over tp (``tp_dim=2``)
``colwise`` (a 3-D parameter)         dimension 1 split: the experts' output features, or the
                                      input features of experts stored ``(E, in, out)`` (Llama
                                      4's ``down_proj``, whose partial sums the module's output
                                      sums)
``rowwise`` (a 3-D parameter)         dimension 2 (the experts' input features) split
``moe_tp_experts`` (the module)       its activations (``hidden_states``) and routing weights
                                      enter the region (fwd identity, bwd all-reduce: each rank's
                                      gradient of them is partial), its output leaves it (fwd
                                      all-reduce of the ranks' partial sums, bwd identity)
===================================  =====================================================

The module's own forward runs unchanged on its slices (its ``chunk(2)`` of gate_up finds this
rank's gate and up halves). The router and shared experts follow the rest of the plan (dense
styles, or replicated). Refused, naming ``--tp`` and the family: an experts module with a
parameter the plan leaves whole (a bias would be added on every rank, then summed), experts
stored transposed or with gate and up interleaved (a packed split would cut the wrong features),
a split dimension not divisible by tp. Under sequence parallelism the router runs on this
rank's chunk of the tokens, between the tensor-parallel regions, and the experts' region
gathers its rows over tp (the hook's docstring; Llama 4's experts, taking the tokens in
expert-major blocks, each expert's block). Under expert parallelism (ep > 1)
the experts are spread over ep instead (:mod:`trainmesh.expert_parallel.hf`) and stay whole on
every TP rank, as the built-in GPT's: these styles are then not applied.

From transformers 5.25 the plans leave the experts out (their parallelism is the expert plan's):
the experts, recognised by their stacked parameters
(:func:`~trainmesh.core.hf_routing.stacked_experts`), then stay whole on every TP rank and run
on the tokens the rank holds, as transformers runs them. A ``moe_tp_experts`` module that holds
no stacked experts is refused, naming ``--tp`` and the family.
"""
from __future__ import annotations

import inspect
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import base_name
from trainmesh.core.hf_routing import stacked_experts
from trainmesh.core.placement import Placements

from .layers import TPState
from .mappings import (
    copy_to_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
)

PARAM_STYLES = {"packed_colwise": (1, 2), "packed_rowwise": (2, 2), "colwise": (1, 1),
                "rowwise": (2, 1)}
"""Style on a stacked 3-D parameter -> (dimension split over tp, blocks split separately)."""
MODULE_STYLE = "moe_tp_experts"


def _prefixed(model: nn.Module, pattern: str) -> str:
    prefix = base_name(model)
    return f"{prefix}.{pattern}" if prefix else pattern


def _declared(model: nn.Module) -> dict[str, str]:
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return dict(plan) if plan else {}


def _family(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def is_expert_entry(model: nn.Module, pattern: str, style: str) -> bool:
    """Whether the declared (prefixed) ``pattern`` is handled here: the experts module style, or
    any style on parameters (the module plan of :mod:`.hf` covers modules only)."""
    return style == MODULE_STYLE or any(fnmatchcase(n, pattern) for n, _ in model.named_parameters())


def expert_entries(model: nn.Module) -> tuple[dict[str, str], list[str]]:
    """({stacked parameter name: style}, [experts module names]) of the declared plan, in model
    order."""
    declared = {_prefixed(model, p): s for p, s in _declared(model).items()}
    params = {n: s for n, _ in model.named_parameters() for p, s in declared.items()
              if fnmatchcase(n, p) and s != MODULE_STYLE}
    modules = [n for n, _ in model.named_modules()
               if n and any(s == MODULE_STYLE and fnmatchcase(n, p) for p, s in declared.items())]
    return params, modules


def check_expert_tp(model: nn.Module, tp: int, *, ep: int = 1, sequence_parallel: bool = False) -> None:
    """Before any communication (and before any worker starts): the declared expert styles can
    be honoured at ``tp`` (module docstring; ConfigError naming ``--tp`` or
    ``--sequence-parallel`` and the family). Under ep > 1 only that sequence parallelism is
    off (the experts are whole there, run on no TP region)."""
    params, modules = expert_entries(model)
    if not (params or modules or stacked_experts(model)):
        return
    family = _family(model)
    if ep > 1 and sequence_parallel:      # dispatched over ep from each TP rank's chunk: not done
        raise ConfigError("--sequence-parallel", f"{family}: its experts, spread over ep, would "
                          "get each TP rank's chunk of the tokens to dispatch; valid: "
                          "--sequence-parallel with --ep 1 (the experts split over tp where its "
                          "plan splits them, else whole on every TP rank)")
    if ep > 1:
        return
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name, style in params.items():
        owner = name.rpartition(".")[0]
        if style not in PARAM_STYLES or len(shapes[name]) != 3:
            raise ConfigError("--tp", f"{family}: its base_model_tp_plan gives the parameter {name} "
                              f"{shapes[name]} the style {style!r}; mapped on stacked experts: "
                              f"{', '.join(PARAM_STYLES)}")
        if owner not in modules:
            raise ConfigError("--tp", f"{family}: {name} is split ({style}) outside a "
                              f"{MODULE_STYLE} module, so its partial outputs are never summed")
        module = model.get_submodule(owner)
        if style == "packed_colwise" and (getattr(module, "is_transposed", False)
                                          or not getattr(module, "is_concatenated", True)):
            raise ConfigError("--tp", f"{family}: {name} is stored transposed or with gate and up "
                              "interleaved, so a packed split would cut the wrong features")
        dim, parts = PARAM_STYLES[style]
        if shapes[name][dim] % (parts * tp):
            raise ConfigError("--tp", f"{family}: {name} {shapes[name]}: dimension {dim} in "
                              f"{parts} part(s) is not divisible by --tp {tp}")
    stacked = stacked_experts(model)
    for owner in modules:
        module = model.get_submodule(owner)
        if owner not in stacked:         # its hooks sum outputs a whole module computes per rank
            raise ConfigError("--tp", f"{family}: its base_model_tp_plan gives {owner} "
                              f"({type(model.get_submodule(owner)).__name__}) the style "
                              f"{MODULE_STYLE!r}, but it holds no stacked experts (one slice "
                              "per expert along dimension 0 of each parameter)")
        for local, _ in model.get_submodule(owner).named_parameters():
            if f"{owner}.{local}" not in params:
                raise ConfigError("--tp", f"{family}: {owner}.{local} is left whole by its "
                                  "base_model_tp_plan, so every rank would add it to the sum")


def apply_expert_tp(model: nn.Module, state: TPState, records: Placements, *, ep: int = 1) -> None:
    """Split the stacked experts and hook their modules (module docstring), in place; records
    each slice's placement under its name. Nothing under ep > 1."""
    check_expert_tp(model, state.size, ep=ep, sequence_parallel=state.sequence_parallel)
    if ep > 1:
        return
    params, modules = expert_entries(model)
    for name, style in params.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        dim, parts = PARAM_STYLES[style]
        shard, placement = state.shard(owner._parameters[leaf], dim, parts)   # (E, ../tp, ..)
        owner._parameters[leaf] = shard
        records.record(name, placement)
    for owner in modules:
        _hook_experts(model.get_submodule(owner), state)


def _hook_experts(module: nn.Module, state: TPState) -> None:
    """``moe_tp_experts``: the activations and routing weights (arguments 0 and 2, by position
    or keyword) enter the region, the output leaves it. Under sequence parallelism the router
    ran on this rank's chunk of the tokens (rows ``(b·s/tp, ·)``): the activations, chosen
    experts and routing weights are all-gathered over tp by rows (backward: reduce-scatter of
    their partial gradients), the output reduce-scattered back to this rank's rows."""
    import inspect
    names = list(inspect.signature(module.forward).parameters)[:3]
    sp, comm, axis = state.sequence_parallel, state.comm, state.axis
    blocks = len(names) == 1          # Llama 4: (E·T/tp, d), the tokens in expert-major blocks
    experts = int(getattr(module, "num_experts", 1))

    def enter(i: int, x: Any) -> Any:
        if sp and blocks:             # each expert's block gathered: (E, T/tp, d) -> (E, T, d)
            return gather_from_sequence(x.view(experts, -1, x.shape[-1]), comm, axis,
                                        dim=1).reshape(-1, x.shape[-1])
        if sp:                        # hidden_states (T/tp, d), top_k_index, top_k_weights (T/tp, k)
            return gather_from_sequence(x, comm, axis, dim=0)
        return copy_to_region(x, comm, axis) if i != 1 else x

    def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for i in (0, 1, 2):
            if i == 0 and state.inside_region:
                continue              # entered already, with its parent's input
            if i < len(args):
                args[i] = enter(i, args[i])
            elif i < len(names) and names[i] in kwargs:
                kwargs[names[i]] = enter(i, kwargs[names[i]])
        return tuple(args), kwargs

    def leave(_m: nn.Module, _a: Any, out: Any) -> Any:
        if sp and blocks:             # (E, T, d) partial sums -> this rank's (E, T/tp, d)
            return reduce_scatter_to_sequence(out.view(experts, -1, out.shape[-1]), comm, axis,
                                              dim=1).reshape(-1, out.shape[-1])
        if sp:
            return reduce_scatter_to_sequence(out, comm, axis, dim=0)
        return reduce_from_region(out, comm, axis)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(leave)
