"""From a trainmesh checkpoint back to a Hugging Face model directory (``export-hf``).

``trainmesh checkpoint export-hf DIR OUTDIR`` writes ``OUTDIR/config.json`` and
``OUTDIR/model.safetensors`` from the newest checkpoint under ``DIR``, loadable with
``AutoModelForCausalLM.from_pretrained(OUTDIR)``:

- a run of a Hugging Face model (``--model-dir``, or any model with a ``config`` that
  ``to_json_string``s): the checkpoint records the model's config (:func:`model_record`); the
  weights are its parameters, tied aliases included, under the names ``save_pretrained``
  writes (transformers' conversion reversed: a mixture of experts held stacked is written
  expert by expert, as Mixtral's and Qwen-MoE's files hold them);
- the built-in GPT: it maps onto GPT-2 exactly — ``embed.wte/wpe`` -> ``transformer.wte/wpe``;
  per block ``ln1``/``ln2`` -> ``ln_1``/``ln_2``, ``attn.q/k/v`` fused into the ``Conv1D``
  ``attn.c_attn`` ([q | k | v], weights transposed), ``attn.proj`` -> ``attn.c_proj``,
  ``mlp.fc``/``mlp.proj`` -> ``mlp.c_fc``/``mlp.c_proj``; ``head.ln_f`` -> ``transformer.ln_f``,
  ``head.out`` -> ``lm_head`` (untied: ``tie_word_embeddings=False``), exact GELU
  (``activation_function="gelu"``), no dropout, LayerNorm eps 1e-5.

The built-in GPT with experts (``--experts``) is refused with a ConfigError naming ``DIR``: no
Hugging Face architecture reproduces it (its experts are GELU MLPs with biases in a GPT-2 body
with learned positions; the MoE families transformers has use RMSNorm, rotary positions and
gated SiLU experts); ``consolidate`` writes its weights. Anything else (a model of one's own
without a Hugging Face config) is refused likewise. The built-in GPT's export holds one output
tensor (a block's fused q|k|v at most) in memory at a time; a Hugging Face model's goes through
transformers' conversion, which takes the whole state.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError

GPT_BLOCK = re.compile(r"blocks\.(\d+)\.")
GPT_MOE = re.compile(r"blocks\.\d+\.mlp\.(router|experts)\.")
"""A mixture-of-experts block of the built-in GPT (no Hugging Face architecture matches it)."""


def model_record(module: nn.Module) -> dict[str, Any]:
    """What a checkpoint keeps about the model for consolidation and export: ``tied`` (alias ->
    the name the weight is saved under) and, for a Hugging Face model, ``hf_config``."""
    from trainmesh.models.hf_weights import tied_aliases
    out: dict[str, Any] = {}
    tied = tied_aliases(module)
    if tied:
        out["tied"] = tied
    config = getattr(module, "config", None)
    if hasattr(config, "to_json_string") and hasattr(config, "model_type"):
        out["hf_config"] = json.loads(config.to_json_string(use_diff=False))
    return out


def gpt_to_gpt2(weights: Mapping[str, torch.Tensor], heads: int,
                specs: Callable[[str], tuple[torch.dtype, tuple[int, ...]]] | None = None,
                ) -> tuple[dict[str, Any], dict[str, Callable[[], torch.Tensor]]]:
    """The built-in GPT's weights as a GPT-2 (config, name -> a function making the tensor);
    module docstring. ``specs(name)``: (dtype, shape) of a weight without reading it."""
    spec = specs or (lambda name: (weights[name].dtype, tuple(weights[name].shape)))
    vocab, d = spec("embed.wte.weight")[1]
    layers = 1 + max(int(m.group(1)) for k in weights if (m := GPT_BLOCK.match(k)))
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
              "n_positions": spec("embed.wpe.weight")[1][0], "n_embd": d, "n_layer": layers,
              "n_head": heads, "n_inner": spec("blocks.0.mlp.fc.weight")[1][0],
              "activation_function": "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 0, "eos_token_id": 0}

    def same(name: str) -> Callable[[], torch.Tensor]:
        return lambda: weights[name]

    def transposed(name: str) -> Callable[[], torch.Tensor]:
        return lambda: weights[name].t()

    def fused(names: list[str], *, t: bool) -> Callable[[], torch.Tensor]:   # Conv1D: [q | k | v]
        return lambda: torch.cat([weights[n].t() for n in names], 1) if t else torch.cat([weights[n] for n in names])

    out = {"transformer.wte.weight": same("embed.wte.weight"),
           "transformer.wpe.weight": same("embed.wpe.weight"),
           "transformer.ln_f.weight": same("head.ln_f.weight"),
           "transformer.ln_f.bias": same("head.ln_f.bias"),
           "lm_head.weight": same("head.out.weight")}
    for i in range(layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{dst}{b}.{kind}"] = same(f"{src}{a}.{kind}")
        out[f"{dst}attn.c_attn.weight"] = fused([f"{src}attn.{w}.weight" for w in "qkv"], t=True)
        out[f"{dst}attn.c_attn.bias"] = fused([f"{src}attn.{w}.bias" for w in "qkv"], t=False)
        for a, b in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[f"{dst}{b}.weight"] = transposed(f"{src}{a}.weight")
            out[f"{dst}{b}.bias"] = same(f"{src}{a}.bias")
    return config, out


def export_hf(root: str | Path, outdir: str | Path) -> Path:
    """Write the Hugging Face directory of the newest checkpoint under ``root``; ConfigError
    naming ``DIR`` for a checkpoint that maps onto no Hugging Face model."""
    from trainmesh.checkpoint.sharded import (
        CheckpointError,
        newest_intact,
        read_weights,
        reading,
    )
    from trainmesh.checkpoint.stream import write_safetensors
    directory, skipped = newest_intact(root)
    if directory is None:
        why = f" ({skipped[0][0].name}: {skipped[0][1]})" if skipped else ""
        raise ConfigError("DIR", f"no intact checkpoint under {root}{why}")
    try:
        weights, manifest = read_weights(directory)
    except CheckpointError as exc:
        raise ConfigError("DIR", str(exc)) from None
    trainer = manifest.get("trainer") or {}
    if "hf_config" in trainer:
        from trainmesh.models.hf_weights import file_state
        config = dict(trainer["hf_config"])
        # transformers' conversion takes the state whole (e.g. stacked experts one by one)
        state = file_state(config, {k: weights[k] for k in weights}, field="DIR")
        makers = {k: (lambda v=v: v) for k, v in state.items()}
    elif "embed.wte.weight" in weights and "head.out.weight" in weights:
        if any(GPT_MOE.match(k) for k in weights):
            raise ConfigError("DIR", f"{directory}: the built-in GPT with experts (--experts) maps "
                              "onto no Hugging Face architecture exactly (GPT-2 has no mixture of "
                              "experts; Mixtral, Qwen-MoE and OLMoE use RMSNorm, rotary positions "
                              "and gated SiLU experts); `trainmesh checkpoint consolidate` writes "
                              "its full weights")
        heads = (trainer.get("run") or {}).get("heads")
        if not isinstance(heads, int):
            raise ConfigError("DIR", f"{directory}: the built-in GPT's head count is not recorded "
                              "(checkpoints of `trainmesh train` record it)")
        config, makers = gpt_to_gpt2(weights, heads, weights.spec)
    else:
        raise ConfigError("DIR", f"{directory}: not a Hugging Face model (no config recorded) nor "
                          "the built-in GPT; valid: a --save-dir of a --model-dir run or of the "
                          "built-in GPT")
    config.setdefault("torch_dtype", "float32")
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    with reading(directory):   # one tensor in memory at a time (two passes: shapes, then data)
        specs = {}
        for name, make in makers.items():
            t = make()
            specs[name] = (t.dtype, tuple(t.shape))
            del t
        write_safetensors(out / "model.safetensors", makers, metadata={"format": "pt"}, specs=specs)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out
