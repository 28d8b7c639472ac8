"""Tensor-parallel plans of Hugging Face models: the one the model declares, mapped onto ours.

A Hugging Face model declares its plan in ``config.base_model_tp_plan`` (``{"layers.*.self_attn.
q_proj": "colwise", ...}``, patterns relative to the base model): :func:`hf_tp_plan` reads it,
prefixes the patterns with the base model's attribute (``model.``) and maps each style onto
trainmesh's (:mod:`.plan`), so every family that declares a plan (Llama, Qwen2/Qwen3, Mistral,
Gemma/Gemma2, Phi-3, ...) runs without a table here:

==============================  =====================================================
Hugging Face style              trainmesh
==============================  =====================================================
``colwise`` / ``rowwise``       ``colwise`` / ``rowwise``
``colwise_gather_output`` +     a fused projection split per part and no gather where the
``rowwise_split_input``         parts are known (Phi-3: ``qkv_proj`` = q, k, v of grouped-query
                                sizes, ``gate_up_proj`` = gate, up) -> ``colwise_parts:...`` +
                                ``rowwise``; otherwise ``colwise_gather`` + ``rowwise_split_input``
``replicated_with_grad_allreduce``  ``partial_grad`` (Qwen3's per-head q/k norms)
``embedding_rowwise``           ``vocab_embedding``
``packed_colwise`` (a Linear)   ``colwise_parts:2`` (gate and up, each split)
``mla_kv_a_proj``               ``partial_grad``, its attention entered once (below)
styles on stacked experts and   applied by :mod:`.hf_experts` (``packed_colwise``, ``colwise``,
``moe_tp_experts``              ``rowwise`` on 3-D parameters; the experts module's hooks)
anything else                   ConfigError naming it and the family
==============================  =====================================================

``mla_kv_a_proj`` is multi-head latent attention's shared projection (DeepSeek-V2/V3): its output
is the key/value latent, normed and expanded per head by the column layer ``kv_b_proj``, and a
rotary key every head reads unsplit. Whole on every rank, its output's gradient comes from this
rank's heads only, which transformers completes by an all-reduce in backward (of the rotary part;
its column layers all-reduce their inputs' gradients). trainmesh enters such an attention's
region once (``parallel_input``), so everything the plan leaves whole inside it — this
projection and the others before the column layers (``q_a_proj`` and the latents' norms) —
gets a gradient summed over tp (``partial_grad``): the same sums.

A declared pattern that matches nothing in this model (a dense MLP's in a config whose every
layer is a mixture of experts) is left out; a parent style is given only to the modules that
hold the split layers (a dense MLP, not the MoE block another pattern also matches).

Each attention module whose projections are split gets ``parallel_input`` (q, k and v enter the
region once) and ``local_heads`` (its head counts, and a copy of its ``config``, become this
rank's: Phi-3 reads ``config.num_attention_heads`` in forward); an MLP with several column
layers gets ``parallel_input``. A module holding a gathered column layer
(``colwise_gather_output``: OLMo 2/3's q, k and v, gathered whole for their norms over every
head) gets ``parallel_input`` too, and keeps its head counts: under sequence parallelism its
input is then gathered along the sequence before its own code reads the shape (its heads
reshaped as ``(b, s, heads, d)``, the rotary tables of the whole sequence), and its row layer
scatters the output back. Embeddings, norms and ``lm_head`` stay replicated (the loss is the
model's own). GPT-2 declares no plan: its own is kept here (the fused ``Conv1D`` ``c_attn``
split per q/k/v block, local head counts). Head counts must divide by tp (ConfigError naming
``tp``). Sequence parallelism adds entries drawn from the model's pipeline plan
(:mod:`.hf_sequence`).
"""
from __future__ import annotations

import copy

from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import base_name

STYLE_MAP = {"colwise": "colwise", "rowwise": "rowwise", "embedding_rowwise": "vocab_embedding",
             "replicated_with_grad_allreduce": "partial_grad",
             "colwise_gather_output": "colwise_gather", "rowwise_split_input": "rowwise_split_input",
             "packed_colwise": "colwise_parts:2", "mla_kv_a_proj": "partial_grad"}
"""Hugging Face tensor-parallel style -> trainmesh style (fused pairs refined by :func:`_fuse`)."""


def hf_model_type(model: nn.Module) -> str | None:
    """``config.model_type`` of a Hugging Face model (recognised without importing
    transformers), else None."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if isinstance(kind, str) else None


def declared_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own ``config.base_model_tp_plan`` (Hugging Face names), or None."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return dict(plan) if plan else None


def hf_tp_plan(model: nn.Module) -> dict[str, str | tuple[str, ...]]:
    """The tensor-parallel plan of a Hugging Face model (module docstring); ValueError for a
    model that declares none (other than GPT-2), ConfigError naming ``tp_plan=`` for a declared
    style trainmesh cannot map."""
    names = dict(model.named_modules())
    if hf_model_type(model) == "gpt2":
        p = "transformer." if "transformer" in names else ""
        return {f"{p}h.*.attn": ("parallel_input", "local_heads"),
                f"{p}h.*.attn.c_attn": "colwise_qkv", f"{p}h.*.attn.c_proj": "rowwise",
                f"{p}h.*.mlp.c_fc": "colwise", f"{p}h.*.mlp.c_proj": "rowwise"}
    declared = declared_plan(model)
    if declared is None:
        raise ValueError(f"no Hugging Face tensor-parallel plan for {type(model).__name__} (model_type "
                         f"{hf_model_type(model)!r}: its config declares no base_model_tp_plan). "
                         "Pass a plan of your own (tp_plan=...)")
    from fnmatch import fnmatchcase

    from .hf_experts import is_expert_entry
    prefix = base_name(model)
    prefix = prefix + "." if prefix else ""
    plan: dict[str, str | tuple[str, ...]] = {}
    for pattern, style in declared.items():
        if is_expert_entry(model, prefix + pattern, style):
            continue                     # stacked experts: hf_experts applies them
        if not any(n and fnmatchcase(n, prefix + pattern) for n in names):
            continue                     # a kind of layer this model does not have
        if style not in STYLE_MAP:
            raise ConfigError("tp_plan", f"the {hf_model_type(model)} family's declared style "
                              f"{style!r} (for {pattern!r}, config.base_model_tp_plan) has no "
                              f"trainmesh counterpart; mapped: {', '.join(STYLE_MAP)}. Pass a "
                              "plan of your own (tp_plan=...)")
        plan[prefix + pattern] = STYLE_MAP[style]
    latent = [prefix + p for p, style in declared.items() if style == "mla_kv_a_proj"
              and prefix + p in plan]
    return _latent_attention(model, _fuse(model, plan, latent), latent)


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


def _fuse(model: nn.Module, plan: dict[str, str | tuple[str, ...]], latent: list[str]
          ) -> dict[str, str | tuple[str, ...]]:
    """Fused projections split per part (so no output is gathered), attention parents (one
    holding a ``latent`` projection entered once, whatever its column layers)."""
    from fnmatch import fnmatchcase
    modules = dict(model.named_modules())

    def first(pattern: str) -> tuple[str, nn.Module] | None:
        return next(((n, m) for n, m in modules.items() if n and fnmatchcase(n, pattern)), None)

    out = dict(plan)
    for pattern, style in plan.items():
        if style != "colwise_gather":
            continue
        split_input = [q for q, s in plan.items() if s == "rowwise_split_input"
                       and _parent(q) == _parent(pattern)]
        found, parent = first(pattern), first(_parent(pattern))
        if not split_input or found is None or parent is None:
            continue
        parts = _fused_parts(found[1], parent[1], attention=_is_attention(*parent))
        if parts is not None:
            out[pattern] = "colwise_parts:" + ",".join(map(str, parts))
            out[split_input[0]] = "rowwise"
    columns: dict[str, int] = {}
    gathered: set[str] = set()
    for pattern, style in out.items():
        if isinstance(style, str) and style.startswith("colwise"):
            columns[_parent(pattern)] = columns.get(_parent(pattern), 0) + 1
            if style == "colwise_gather":
                gathered.add(_parent(pattern))
    for parent_pattern, n in columns.items():
        found = first(parent_pattern)
        if found is None:
            continue
        once = n > 1 or parent_pattern in {_parent(p) for p in latent} or parent_pattern in gathered
        styles: tuple[str, ...] = ("parallel_input",) if once else ()
        split_heads = any(_parent(p) == parent_pattern and isinstance(s, str)
                          and s.startswith("colwise") and s != "colwise_gather" for p, s in out.items())
        if _is_attention(*found) and split_heads:      # gathered outputs keep every head
            styles += ("local_heads",)
        if styles:
            for parent in _holding(modules, parent_pattern, out):
                out[parent] = styles
    return out


def _latent_attention(model: nn.Module, plan: dict[str, str | tuple[str, ...]], latent: list[str]
                      ) -> dict[str, str | tuple[str, ...]]:
    """``partial_grad`` for every module with parameters the plan leaves whole inside an
    attention holding a ``latent`` (``mla_kv_a_proj``) projection (module docstring); the
    attention must be entered once (a region with a column layer), else ConfigError naming
    ``tp_plan`` and the family."""
    from fnmatch import fnmatchcase
    out = dict(plan)
    for pattern in latent:
        parent_pattern = _parent(pattern)
        for parent, module in model.named_modules():
            if not fnmatchcase(parent, parent_pattern):
                continue
            if not any("parallel_input" in styles and fnmatchcase(parent, p) for p, styles in plan.items()):
                raise ConfigError("tp_plan", f"the {hf_model_type(model)} family's declared style "
                                  f"'mla_kv_a_proj' (for {pattern!r}) needs {parent}'s heads split "
                                  "by a column layer; its plan splits none")  # else sums double
            for local, child in module.named_modules():
                name = f"{parent}.{local}" if local else parent
                whole = not any(fnmatchcase(name, p) for p in plan if p != parent_pattern)
                if local and whole and any(True for _ in child.parameters(recurse=False)):
                    out[f"{parent_pattern}.{local}"] = "partial_grad"   # replicated, in the region
    return out


def _holding(modules: dict[str, nn.Module], parent_pattern: str,
             plan: dict[str, str | tuple[str, ...]]) -> list[str]:
    """``parent_pattern`` when every module it matches holds a layer the plan splits (a layer
    style, not another parent's); else the names of those that do (an MoE block matched with
    the dense MLPs keeps no parent style, even when it holds split shared experts)."""
    from fnmatch import fnmatchcase
    children = [p for p, style in plan.items() if isinstance(style, str) and _parent(p) == parent_pattern]
    matched = [n for n in modules if n and fnmatchcase(n, parent_pattern)]
    holding = [n for n in matched
               if any(fnmatchcase(c, p) for c in modules if _parent(c) == n for p in children)]
    return [parent_pattern] if holding == matched else holding


def _fused_parts(linear: nn.Module, parent: nn.Module, *, attention: bool) -> tuple[int, ...] | None:
    """The output blocks of a fused projection: q, k, v (grouped-query sizes) of an attention,
    or two equal halves (gate, up) of an MLP (never of an attention: OLMoE's q_proj, gathered
    for its norm, is as wide as two of its experts' halves); None when they cannot be told."""
    out = getattr(linear, "out_features", None)
    config = getattr(parent, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(out, int) and heads and head_dim and out == (heads + 2 * kv) * head_dim:
        return heads * head_dim, kv * head_dim, kv * head_dim
    inter = getattr(config, "intermediate_size", None)
    if not attention and isinstance(out, int) and inter and out == 2 * inter:
        return inter, inter
    return None


def _is_attention(name: str, module: nn.Module) -> bool:
    leaf = name.rpartition(".")[2].lower()
    return hasattr(module, "head_dim") or "attn" in leaf or "attention" in leaf


def localize_config(module: nn.Module, tp: int) -> None:
    """``local_heads`` on a Hugging Face attention: its own copy of the config with this rank's
    head counts (the model's config, shared by every layer, stays whole)."""
    config = getattr(module, "config", None)
    if config is None or not isinstance(getattr(config, "num_attention_heads", None), int):
        return
    local = copy.copy(config)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(local, attr, value // tp)
    module.config = local


def head_counts(module: nn.Module) -> dict[str, int]:
    """The head counts of an attention module: its own, then its (Hugging Face) config's."""
    config = getattr(module, "config", None)
    found = {a: getattr(module, a, None) for a in ("num_heads", "num_key_value_heads")}
    found.update({a: getattr(config, a, None) for a in ("num_attention_heads", "num_key_value_heads")
                  if a not in found or found[a] is None})
    return {a: v for a, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}


def check_hf_tp(model: nn.Module, tp: int) -> None:
    """Before any communication: the head counts divide by ``tp`` (ConfigError naming it)."""
    for attr, count in head_counts(model).items():   # the model's config
        if count % tp:
            raise ConfigError("tp", f"the model's {attr} = {count} is not divisible by --tp {tp} "
                              "(each rank holds whole heads)")
