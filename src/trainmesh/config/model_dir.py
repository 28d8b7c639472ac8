"""``trainmesh train --model-dir``'s rules, checked before any worker starts."""
from __future__ import annotations

from typing import Any

from trainmesh.core.errors import ConfigError
from trainmesh.models.hf import max_positions, n_experts, read_model_config
from trainmesh.strategies import table


def check_expert_count(config: dict[str, Any], ep: int) -> None:
    """--ep > 1 spreads a mixture of experts' experts: ``ep`` must divide the count config.json
    gives (ConfigError naming --ep). A config without a count field this reads is not taken
    for a dense model: the model's expert plan, declared or inferred, decides (the preflight's
    :func:`trainmesh.expert_parallel.hf.check_hf_ep`, naming what it could not place)."""
    experts = n_experts(config)
    if ep == 1 or not experts:
        return
    if experts % ep:
        raise ConfigError("--ep", f"must divide the model's {experts} experts; got {ep}")


def check_causal_lm(config: dict[str, Any], path: str, field: str = "--model-dir") -> None:
    """The model is a causal LM: an encoder (BERT, RoBERTa, ...: a masked LM attending both
    ways) trains as a causal LM only with a decoder config (``is_decoder: true``), and a type
    with no causal LM class never (ConfigError naming ``field``). Where transformers is not
    installed, nothing is checked here (building the model needs it and says so)."""
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
        )
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
        )
    except ImportError:
        return
    kind = config.get("model_type")
    if kind in MASKED and (kind not in CAUSAL or not config.get("is_decoder")):
        unless = ", or this config.json with is_decoder: true" if kind in CAUSAL else ""
        raise ConfigError(field, f"{path!r} is an encoder ({kind}: a masked LM, attention both "
                          f"ways); valid: a causal (decoder-only) LM's directory{unless}")


def check_model_config(cfg: Any) -> int:
    """``trainmesh train --model-dir``'s rules, before any worker starts: the directory and its
    config.json (:func:`read_model_config`), no flag that the config sets or the model cannot
    run, --ep only for a mixture of experts whose experts it divides, head counts divisible by
    --tp, --seq-len within the positions and divisible by what splits it (--cp,
    --sequence-parallel); ``cfg`` is the TrainConfig. What the model's plans allow is checked on
    the model (:func:`trainmesh.engine.pretrained.check_model_dir`). Returns the vocabulary of
    the data: --vocab-size, or the model's."""
    config = read_model_config(cfg.model_dir)
    check_causal_lm(config, cfg.model_dir)
    p = cfg.parallel
    for flag, given in (("--layers", cfg.layers), ("--d-model", cfg.d_model), ("--heads", cfg.heads),
                        ("--init-from", cfg.init_from)):
        if given is not None:
            raise ConfigError(flag, f"is set by --model-dir ({cfg.model_dir}); valid: leave it out")
    table.check(p, cfg.facts(hub=True))   # the table's rules on a hub model (its ties: preflight)
    check_expert_count(config, p.ep)
    heads = {"attention heads": config.get("n_head") or config.get("num_attention_heads"),
             "key/value heads": config.get("num_key_value_heads")}
    for what, count in heads.items():
        if isinstance(count, int) and count % p.tp:
            raise ConfigError("--tp", f"must divide the model's {count} {what} ({cfg.model_dir})")
    seq, longest = cfg.gpt_config().seq_len, max_positions(config)
    if isinstance(longest, int) and seq > longest:
        raise ConfigError("--seq-len", f"must be at most the model's {longest} positions; got {seq}")
    _check_sequence_split(seq, p)
    vocab = config.get("vocab_size")
    if cfg.vocab_size is not None and isinstance(vocab, int) and cfg.vocab_size > vocab:
        raise ConfigError("--vocab-size", f"the data's vocabulary must fit the model's {vocab} "
                          f"tokens; got {cfg.vocab_size}")
    return cfg.vocab_size if cfg.vocab_size is not None else vocab


def _check_sequence_split(seq: int, p: Any) -> None:
    """--cp holds 2 of 2cp equal chunks of every sequence, --sequence-parallel 1/tp of a rank's
    share between the layers: both must divide it."""
    if p.cp > 1 and seq % (2 * p.cp):
        raise ConfigError("--seq-len", f"must be divisible by 2 x --cp = {2 * p.cp} (each rank "
                          f"holds 2 of 2cp chunks of a sequence); got {seq}")
    if p.sequence_parallel and (seq // p.cp) % p.tp:
        raise ConfigError("--seq-len", f"seq-len / cp = {seq // p.cp} must be divisible by --tp "
                          f"{p.tp} with --sequence-parallel (each rank holds 1/tp of it between "
                          "the layers)")
