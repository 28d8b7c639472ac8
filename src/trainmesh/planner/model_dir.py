"""A Hugging Face model directory as the planner sees it (``trainmesh plan --model-dir DIR``).

Reads ``config.json`` (nothing is built, no weights are read) into a :class:`~.shapes.ModelShape`:

* layers ``num_hidden_layers`` (``n_layer``), hidden ``hidden_size`` (``n_embd``), heads
  ``num_attention_heads`` (``n_head``), key/value heads ``num_key_value_heads``, head width
  ``head_dim`` (DeepSeek: ``qk_nope_head_dim + qk_rope_head_dim``, its latent attention's
  low-rank projections ``q_lora_rank``/``kv_lora_rank`` counted as such), MLP width
  ``intermediate_size`` (``n_inner``), vocabulary, tied embeddings; Llama-style families
  (a ``hidden_act`` of silu and an ``intermediate_size``) have a gated MLP and RMSNorm.
* experts: ``num_local_experts`` (Mixtral), ``num_experts`` (Qwen-MoE), ``n_routed_experts``
  (DeepSeek); top-k ``num_experts_per_tok``; expert width ``moe_intermediate_size`` (else the
  MLP width); shared experts ``shared_expert_intermediate_size`` (Qwen-MoE) or
  ``n_shared_experts x moe_intermediate_size`` (DeepSeek); dense layers ``first_k_dense_replace``
  (DeepSeek), ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen-MoE).
* the parameter count from these shapes (embeddings, attention with its key/value heads, MLPs or
  experts and router, norms, the head unless tied).
* plans: the ones ``trainmesh train`` would train with, chosen by the same function
  (:func:`trainmesh.models.hf_plans.install_plans` on the model built on the meta device from
  config.json, no weights read): a plan file's (``--tp-plan``, ``--pp-plan``, ``--ep-plan``),
  else the declared one, else one inferred from the modules. tp, pp and ep are only enumerated
  where there is a plan, cp always; where none can be inferred a note names the module that
  could not be placed (:func:`plan_axes`). Without transformers, the plans config.json itself
  declares.

A directory without a ``config.json`` or whose fields cannot make a shape exits 2 naming
``--model-dir``.
"""
from __future__ import annotations

from typing import Any

from trainmesh.core.errors import ConfigError

from .shapes import ModelShape

FLAG = "--model-dir"
PLANS = {"tp": "base_model_tp_plan", "pp": "base_model_pp_plan", "ep": "base_model_ep_plan"}
KINDS = {"tp": "tensor-parallel", "pp": "pipeline", "ep": "expert-parallel"}


def _int(config: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _moe_layers(config: dict[str, Any], layers: int, experts: int) -> int:
    if not experts:
        return 0
    dense = set(range(_int(config, "first_k_dense_replace") or 0))
    dense |= {i for i in config.get("mlp_only_layers") or [] if isinstance(i, int)}
    step = _int(config, "decoder_sparse_step", "moe_layer_freq") or 1
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def shape_from_config(config: dict[str, Any], *, path: str = "") -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face ``config.json`` (module doc)."""
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    heads = _int(config, "num_attention_heads", "n_head")
    vocab = _int(config, "vocab_size")
    if None in (layers, hidden, heads, vocab):
        raise ConfigError(FLAG, f"{path}: config.json gives no layers, hidden size, heads and "
                          "vocabulary (num_hidden_layers, hidden_size, num_attention_heads, "
                          "vocab_size); valid: a decoder's config.json")
    assert layers and hidden and heads and vocab
    kv = _int(config, "num_key_value_heads") or heads
    rope = _int(config, "qk_rope_head_dim") or 0
    head_dim = ((_int(config, "qk_nope_head_dim") or 0) + rope) or _int(config, "head_dim") \
        or hidden // heads
    ffn = _int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    gated = str(config.get("hidden_act", config.get("activation_function", ""))).lower() in ("silu", "swiglu") \
        and "intermediate_size" in config
    experts = _int(config, "num_local_experts", "num_experts", "n_routed_experts") or 0
    top_k = _int(config, "num_experts_per_tok", "num_experts_per_token", "moe_topk") or 1
    expert_ffn = _int(config, "moe_intermediate_size") or ffn
    shared = _int(config, "shared_expert_intermediate_size") or \
        (_int(config, "n_shared_experts") or 0) * expert_ffn
    moe_layers = _moe_layers(config, layers, experts)
    tied = bool(config.get("tie_word_embeddings", False))
    q, kvw = heads * head_dim, kv * head_dim
    attention = hidden * q + 2 * hidden * kvw + q * hidden
    kv_rank = _int(config, "kv_lora_rank")
    if kv_rank:   # latent attention: low-rank queries and keys/values (DeepSeek)
        q_rank, v_dim = _int(config, "q_lora_rank"), _int(config, "v_head_dim") or head_dim
        nope = head_dim - rope
        queries = hidden * q_rank + q_rank * q if q_rank else hidden * q
        attention = (queries + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
                     + heads * v_dim * hidden + (q_rank or 0) + kv_rank)

    def mlp(width: int) -> int:
        return 3 * hidden * width if gated else 2 * hidden * width + width + hidden

    moe = experts * mlp(expert_ffn) + experts * hidden + (mlp(shared) if shared else 0)
    params = (vocab * hidden * (1 if tied else 2) + layers * (attention + 2 * hidden)
              + (layers - moe_layers) * mlp(ffn) + moe_layers * moe + hidden)
    seq = _int(config, "max_position_embeddings", "n_positions") or 2048
    try:
        return ModelShape(params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                          head_dim=head_dim if head_dim * heads != hidden else None, ffn=ffn,
                          gated=gated, norm="rmsnorm" if gated else "layernorm", vocab=vocab,
                          seq_len=min(seq, 4096), experts=experts,
                          top_k=min(top_k, experts) if experts else 1,
                          expert_ffn=expert_ffn if experts else None, shared_ffn=shared,
                          moe_layers=moe_layers if experts else None)
    except ConfigError as exc:
        raise ConfigError(FLAG, f"{path}: its config.json does not make a shape: {exc}") from None


def declared_axes(config: dict[str, Any]) -> frozenset[str]:
    """The model-parallel axes the model declares plans for, with cp (without transformers:
    what config.json and the config class say, nothing inferred)."""
    declared = {axis for axis, key in PLANS.items() if config.get(key)}
    try:
        import transformers
        cls = transformers.AutoConfig.for_model(config["model_type"]).__class__
        declared |= {axis for axis, key in PLANS.items() if getattr(cls, key, None)}
    except (ImportError, ValueError, KeyError, TypeError):
        pass
    return frozenset(declared | {"cp"})


def plan_axes(path: str, config: dict[str, Any], files: Any = None,
              experts: int = 0) -> tuple[frozenset[str], list[str]]:
    """(the axes the model has plans for, with cp; notes): the plans ``trainmesh train`` takes
    (module doc), ``files`` a :class:`~trainmesh.models.hf_plans.PlanFiles`. A note says where
    a plan was inferred and, where none could be, which module inference could not place (ep
    only for a mixture of ``experts``)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return declared_axes(config), ["transformers is not installed: tp, pp and ep are "
                                       "offered only where config.json declares a plan"]
    from trainmesh.core.hf_infer import not_inferred, plan_source
    from trainmesh.models.hf import build_on_meta
    # every tensor made on meta, buffers too (a DeepSeek-V3 layer's stacked experts are 30 GB),
    # and plans read no values
    model = build_on_meta(path, field=FLAG, plans=files, weights=False, buffers=False)
    axes, notes = {"cp"}, []
    for axis, kind in KINDS.items():
        source = plan_source(model, axis)
        if source is not None:
            axes.add(axis)
        if source == "inferred" and (axis != "ep" or experts):
            checked = " (trainmesh train checks it on the first layer at start)" if axis == "tp" else ""
            notes.append(f"{axis}: {type(model).__name__} declares no {kind} plan; the one "
                         f"inferred from its modules is offered{checked}")
        elif source is None and (axis != "ep" or experts):
            notes.append(f"{axis}: not offered: {type(model).__name__} declares no {kind} plan"
                         f"{not_inferred(model, axis)}; --{axis}-plan FILE gives one")
    return frozenset(axes), notes


def read(path: str, files: Any = None) -> tuple[ModelShape, frozenset[str], dict[str, Any], list[str]]:
    """(shape, the axes it has plans for, config.json, notes on its plans) of a model directory;
    ``files``: the plan files (:func:`plan_axes`)."""
    from trainmesh.config.model_dir import check_causal_lm
    from trainmesh.models.hf import read_model_config
    config = read_model_config(path, FLAG)
    check_causal_lm(config, path, FLAG)   # what trainmesh train refuses, plan refuses too
    shape = shape_from_config(config, path=path)
    axes, notes = plan_axes(path, config, files, shape.experts)
    return shape, axes, config, notes
