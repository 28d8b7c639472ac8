"""Plans inferred from a Hugging Face model's modules, for a family that declares none.

transformers families declare their parallel plans in their config (``base_model_tp_plan``,
``base_model_pp_plan``, ``base_model_ep_plan``); some declare none on an axis (StableLM: no
tensor-parallel or pipeline plan; Llama 4: no pipeline or expert plan; GraniteMoE, PhiMoE:
a pipeline plan holding the head alone). Their models are built from the pieces trainmesh
splits anyway, and these functions derive the plan in the config's own format (patterns
relative to the base model) from what the modules are:

- **tensor parallel** (:func:`infer_tp_plan`): in every decoder layer, an attention — a module
  holding q, k, v and output projections (``nn.Linear``: ``q_proj``/``k_proj``/``v_proj`` with
  ``o_proj``, ``out_proj`` or ``dense``) — gets its q, k, v ``colwise`` (whole heads per rank)
  and its output ``rowwise``; a per-head norm inside it (1-D, ``head_dim`` wide) is
  ``replicated_with_grad_allreduce``; an MLP — ``gate_proj``/``up_proj`` with ``down_proj``,
  ``fc1`` with ``fc2``, ``c_fc`` with ``c_proj`` — its input projections ``colwise`` and its
  output ``rowwise``. Anything else stays whole on every rank.
- **pipeline** (:func:`infer_pp_plan`): the base model's children in registration order — the
  token embedding (the one ``nn.Embedding`` with parameters before the layers), the decoder
  layer list (its one ``nn.ModuleList``), then the modules after it holding norms' 1-D
  parameters only; modules without parameters (rotary tables) run in every stage's capture.
- **expert parallel** (:func:`infer_ep_plan`): each module holding stacked experts
  (:func:`~trainmesh.core.hf_routing.stacked_experts`) is ``ep_dispatch_experts`` and each of
  its parameters ``grouped_gemm`` — when its forward takes the routing
  ``(hidden_states, top_k_index, top_k_weights)``, or takes ``hidden_states`` alone in
  expert-major blocks, the routing applied before it, and holds stacked matrices only (Llama 4).

Where a module cannot be placed, :class:`Uninferable` names it and why (the callers' refusal,
exit 2 before any worker). The tensor-parallel plan is checked on the first layer against the
unsplit layer before any worker starts (:mod:`trainmesh.tensor_parallel.hf_check`). Imports
core only (transformers not at all).
"""
from __future__ import annotations

import inspect
import re

from torch import nn

from .hf_routing import stacked_experts
from .hub_state import recorded

AXES = ("tp", "pp", "ep")
ATTENTION = (("q_proj", "k_proj", "v_proj"), ("o_proj", "out_proj", "dense"))
"""An attention's q, k, v projections and the names its output projection goes by."""
MLPS = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"),
        (("fc1",), "fc2"), (("c_fc",), "c_proj"))
"""An MLP's input projections (column layers) and its output projection (the row layer)."""
EMBED_IO = (["input_ids"], ["inputs_embeds"])
LAYERS_IO = (["hidden_states", "attention_mask"], ["hidden_states"])
NORM_IO = (["hidden_states"], ["hidden_states"])
HEAD_IO = (["hidden_states"], ["logits"])


class Uninferable(Exception):
    """A plan cannot be inferred: ``module`` (its name in the model) could not be placed."""

    def __init__(self, module: str, why: str) -> None:
        super().__init__(f"{module}: {why}")
        self.module, self.why = module, why


def base_name(model: nn.Module) -> str:
    """The base model's attribute (``model``), '' when the model is its own base: the one
    ``base_model_prefix`` names, else (Llama 4's text model names ``language_model``, holds
    ``model``) the one child holding a layer list."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    if any(isinstance(c, nn.ModuleList) for c in model.children()):
        return ""
    holding = [n for n, c in model.named_children()
               if any(isinstance(g, nn.ModuleList) for g in c.children())]
    return holding[0] if len(holding) == 1 else ""


def _full(base: str, local: str) -> str:
    return f"{base}.{local}" if base else local


def layer_list(model: nn.Module) -> str:
    """The decoder layer list's name relative to the base model (``layers``): its one
    ``nn.ModuleList`` child."""
    base = base_name(model)
    lists = [n for n, c in model.get_submodule(base).named_children() if isinstance(c, nn.ModuleList)]
    if len(lists) != 1:
        raise Uninferable(base or type(model).__name__, f"holds {len(lists)} layer lists "
                          f"({lists}); a decoder has exactly one")
    return lists[0]


def _linear(module: nn.Module, name: str) -> bool:
    return type(getattr(module, name, None)) is nn.Linear


def _attention_entries(module: nn.Module) -> dict[str, str] | None:
    """{child: style} of an attention (module docstring), else None."""
    qkv, outs = ATTENTION
    out = next((o for o in outs if _linear(module, o)), None)
    if not all(_linear(module, n) for n in qkv) or out is None:
        return None
    return {**{n: "colwise" for n in qkv}, out: "rowwise"}


def _mlp_entries(module: nn.Module) -> dict[str, str] | None:
    for columns, row in MLPS:
        if all(_linear(module, n) for n in columns) and _linear(module, row):
            return {**{n: "colwise" for n in columns}, row: "rowwise"}
    return None


def _per_head(attention: nn.Module, local: str, name: str, child: nn.Module) -> str:
    """The style of a module with parameters inside an attention besides its projections: a
    norm of the attention over ``head_dim`` (the same for every head: each rank its heads),
    else Uninferable (one norm per head, in a list, would need splitting with the heads)."""
    own = list(child.parameters())
    head_dim = getattr(attention, "head_dim", None)
    if "." not in local and own and all(p.dim() == 1 and p.shape[0] == head_dim for p in own):
        return "replicated_with_grad_allreduce"
    raise Uninferable(name, f"({type(child).__name__}, parameters "
                      f"{[tuple(p.shape) for p in own]}) sits inside the attention beside its "
                      "projections and is not a norm over one head's width, so it cannot be "
                      "split with the heads")


def infer_tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of a model that declares none (module docstring), in
    ``base_model_tp_plan``'s format; Uninferable naming the first layer without an attention
    or a module inside an attention it cannot place."""
    base, layers = base_name(model), layer_list(model)
    plan: dict[str, str] = {}
    experts = set(stacked_experts(model))
    for index, layer in enumerate(model.get_submodule(_full(base, layers))):
        prefix = f"{layers}.{index}"
        found = False
        for sub, module in layer.named_modules():
            entries = _attention_entries(module)
            if entries is not None:
                found = True
                for local, child in module.named_modules():
                    own = any(True for _ in child.parameters(recurse=False))
                    if not local or local in entries or not own:
                        continue
                    name = _full(base, f"{prefix}.{sub}.{local}" if sub else f"{prefix}.{local}")
                    entries[local] = _per_head(module, local, name, child)
            else:
                entries = _mlp_entries(module)
                if entries is None or _full(base, f"{prefix}.{sub}") in experts:
                    continue
            for local, style in entries.items():
                path = f"{sub}.{local}" if sub else local
                plan[f"{layers}.*.{path}"] = style
        if not found:
            raise Uninferable(_full(base, prefix), f"({type(layer).__name__}) holds no attention "
                              "with q/k/v and output projections (q_proj, k_proj, v_proj and "
                              "o_proj, out_proj or dense) to split by heads")
    return plan


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def infer_pp_plan(model: nn.Module) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(the base model's pipeline plan, the whole model's ``pp_plan`` with the head) of a model
    that declares none or one without a layer list (module docstring); Uninferable naming the
    module that cannot be placed."""
    base, layers = base_name(model), layer_list(model)
    children = list(model.get_submodule(base).named_children())
    at = [n for n, _ in children].index(layers)
    plan: dict[str, tuple] = {}
    for name, child in children[:at]:
        if not _has_params(child):
            continue
        if plan or type(child) is not nn.Embedding:
            raise Uninferable(_full(base, name), f"({type(child).__name__}) holds parameters "
                              "before the layers besides the token embedding; a stage without "
                              "it could not run the model's code before the layers")
        plan[name] = EMBED_IO
    if not plan:
        raise Uninferable(base or type(model).__name__, "holds no token embedding "
                          "(nn.Embedding) before its layers")
    first = model.get_submodule(_full(base, f"{layers}.0"))
    if not any(_attention_entries(m) is not None or hasattr(m, "head_dim") for m in first.modules()):
        raise Uninferable(_full(base, f"{layers}.0"), f"({type(first).__name__}) holds no "
                          "attention: not a transformer decoder layer, whose calls the pipeline "
                          "replays")
    plan[layers] = LAYERS_IO
    for name, child in children[at + 1:]:
        if not _has_params(child):
            continue
        if any(p.dim() != 1 for p in child.parameters()):
            raise Uninferable(_full(base, name), f"({type(child).__name__}) holds matrices "
                              "after the layers; only norms (1-D parameters) can follow them")
        plan[name] = NORM_IO
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = [n for n, m in model.named_modules() if head is not None and m is head]
    if not heads:
        raise Uninferable(type(model).__name__, "has no output embeddings (lm_head)")
    whole = {_full(base, n): io for n, io in plan.items()}
    whole[heads[0]] = HEAD_IO
    return plan, whole


def infer_ep_plan(model: nn.Module) -> dict[str, str]:
    """The expert-parallel plan of a model that declares none (module docstring); Uninferable
    naming the experts module whose forward takes neither the routing nor bias-free
    expert-major blocks, or the model when no module holds stacked experts."""
    base = base_name(model)
    names = stacked_experts(model)
    if not names:
        raise Uninferable(type(model).__name__, "no module holds stacked experts (one matrix per "
                          "expert along dimension 0 of each parameter): no experts to spread")
    layers = layer_list(model)
    plan: dict[str, str] = {}
    for name in names:
        module = model.get_submodule(name)
        arguments = list(inspect.signature(module.forward).parameters)
        own = list(module.parameters(recurse=False))
        blocks = len(arguments) == 1 and all(p.dim() == 3 for p in own)   # Llama 4's form
        if len(arguments) < 3 and not blocks:
            raise Uninferable(name, f"({type(module).__name__}) takes ({', '.join(arguments)}), "
                              "neither the routing (hidden_states, top_k_index, top_k_weights) "
                              "nor expert-major blocks of bias-free experts (hidden_states "
                              "alone): its tokens cannot be dispatched to the ranks holding "
                              "their experts")
        local = name[len(base) + 1:] if base else name
        pattern = re.sub(rf"^{re.escape(layers)}\.\d+\.", f"{layers}.*.", local)
        plan[pattern] = "ep_dispatch_experts"
        for leaf, _ in module.named_parameters(recurse=False):
            plan[f"{pattern}.{leaf}"] = "grouped_gemm"
    return plan


def plan_source(model: nn.Module, axis: str) -> str | None:
    """Where ``model``'s plan for ``axis`` came from: file, declared, inferred (None: none, or
    the plans were not installed: a model built by hand); read from its
    :class:`~trainmesh.core.hub_state.HubState`."""
    state = recorded(model)
    return None if state is None else state.plan_sources.get(axis)


def not_inferred(model: nn.Module, axis: str) -> str:
    """Why no plan could be inferred for ``axis`` (' and none can be inferred from its modules
    (<module>: <why>)'), '' when inference was not tried."""
    state = recorded(model)
    why = None if state is None else state.uninferred.get(axis)
    return f" and none can be inferred from its modules ({why})" if why else ""
