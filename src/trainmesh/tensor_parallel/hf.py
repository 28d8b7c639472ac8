"""Tensor-parallel plans for Hugging Face GPT-2 and Llama (Megatron style, vocab replicated).

Recognised by ``model.config.model_type`` (no transformers import): ``GPT2LMHeadModel`` /
``GPT2Model`` and ``LlamaForCausalLM`` / ``LlamaModel``. What each plan splits:

- GPT-2: the fused ``attn.c_attn`` (a ``Conv1D``, weight ``(d, 3d)`` = [q | k | v]) column-split
  per block (``colwise_qkv``), so each rank holds whole heads of q, k and v; ``attn.c_proj``
  row-parallel; the attention's ``num_heads`` and ``split_size`` become the local ones
  (``local_heads``); ``mlp.c_fc`` column-, ``mlp.c_proj`` row-parallel.
- Llama: ``q_proj``, ``k_proj``, ``v_proj`` column-parallel (grouped-query attention: the
  ``num_key_value_heads`` are split too, each rank keeping the kv heads its q heads use), one
  entry into the region for all three (``parallel_input``: Llama passes ``hidden_states=`` by
  keyword), ``o_proj`` row-parallel; ``gate_proj``/``up_proj`` column-, ``down_proj`` row-parallel.
  Rotary embeddings act per head and RMSNorm on replicated activations: both stay as they are.

Embeddings, final norm and ``lm_head`` stay replicated (the loss is the model's own). Each
attention's head counts must divide by tp (ConfigError naming ``tp``); sequence parallelism is
refused (ConfigError naming ``sequence-parallel``): these plans have no sequence-sharded region.
"""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError
MODEL_TYPES = ("gpt2", "llama")


def hf_model_type(model: nn.Module) -> str | None:
    """``"gpt2"`` or ``"llama"`` for a Hugging Face model these plans cover, else None."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if kind in MODEL_TYPES else None


def hf_tp_plan(model: nn.Module) -> dict[str, str | tuple[str, ...]]:
    """The tensor-parallel plan of a Hugging Face GPT-2 or Llama model (module docstring);
    ValueError for another model."""
    kind = hf_model_type(model)
    names = dict(model.named_modules())
    if kind == "gpt2":
        p = "transformer." if "transformer" in names else ""
        return {f"{p}h.*.attn": ("parallel_input", "local_heads"),
                f"{p}h.*.attn.c_attn": "colwise_qkv", f"{p}h.*.attn.c_proj": "rowwise",
                f"{p}h.*.mlp.c_fc": "colwise", f"{p}h.*.mlp.c_proj": "rowwise"}
    if kind == "llama":
        p = "model." if "model" in names else ""
        return {f"{p}layers.*.self_attn": ("parallel_input", "local_heads"),
                f"{p}layers.*.self_attn.[qkv]_proj": "colwise",
                f"{p}layers.*.self_attn.o_proj": "rowwise",
                f"{p}layers.*.mlp": "parallel_input",
                f"{p}layers.*.mlp.gate_proj": "colwise", f"{p}layers.*.mlp.up_proj": "colwise",
                f"{p}layers.*.mlp.down_proj": "rowwise"}
    raise ValueError(f"no Hugging Face tensor-parallel plan for {type(model).__name__} (model_type "
                     f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}); covered: "
                     f"{', '.join(MODEL_TYPES)}. Pass a plan of your own (tp_plan=...)")


def head_counts(module: nn.Module) -> dict[str, int]:
    """The head counts of an attention module: its own, then its (Hugging Face) config's."""
    config = getattr(module, "config", None)
    found = {a: getattr(module, a, None) for a in ("num_heads", "num_key_value_heads")}
    found.update({a: getattr(config, a, None) for a in ("num_attention_heads", "num_key_value_heads")
                  if a not in found or found[a] is None})
    return {a: v for a, v in found.items() if isinstance(v, int) and not isinstance(v, bool)}


def check_hf_tp(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> None:
    """Before any communication: the head counts divide by ``tp`` and no sequence parallelism
    (ConfigError naming the flag)."""
    if sequence_parallel:
        raise ConfigError("sequence-parallel", f"is not supported for Hugging Face "
                          f"{hf_model_type(model)} models (their plan keeps whole sequences); "
                          "valid: without --sequence-parallel")
    for attr, count in head_counts(model).items():   # the model's config
        if count % tp:
            raise ConfigError("tp", f"the model's {attr} = {count} is not divisible by --tp {tp} "
                              "(each rank holds whole heads)")
