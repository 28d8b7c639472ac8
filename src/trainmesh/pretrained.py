"""Hugging Face causal LMs from a local model directory, built so each rank holds only its part.

Any Hugging Face causal LM (``AutoModelForCausalLM``) works under dp and every ZeRO stage,
under tp where it declares a plan. A model directory is what ``save_pretrained`` writes: ``config.json`` and ``model.safetensors``.
:func:`from_pretrained` builds the model from its config with every parameter on the meta
device (buffers, such as Llama's rotary frequencies, are built for real: they are small and
derived from the config) and gives it ``init_parameter`` reading the weights slice by slice
(:func:`~trainmesh.materialize.safetensors_init`). The engine then materialises each rank's part
after the tensor-parallel split — a column shard of a GPT-2 ``Conv1D`` is a slice of its
``(in, out)`` weight, a shard of the fused ``c_attn`` one slice of each of q, k and v — so no
rank ever holds the whole model::

    model = tm.from_pretrained("path/to/dir")
    engine = tm.Engine(model, optimizer, tm.causal_lm_loss, config=tm.ParallelConfig(tp=2))

transformers is an optional dependency (``pip install 'trainmesh[hf]'``), imported only here and
only when a model is built. :func:`check_model_dir` reads ``config.json`` alone (no
transformers) so ``trainmesh train --model-dir`` refuses a bad directory before any worker starts.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError
from .materialize import safetensors_init

WEIGHTS = "model.safetensors"
FIELD = "--model-dir"


def read_model_config(path: str, field: str = FIELD) -> dict[str, Any]:
    """``config.json`` of a model directory as a dict; ConfigError naming ``field`` when the
    directory, the file or a supported ``model_type`` is missing."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigError(field, f"no such directory {path!r}; valid: a Hugging Face model "
                          "directory (config.json + model.safetensors, as save_pretrained writes)")
    try:
        config = json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(field, f"{path!r} has no config.json; valid: a Hugging Face model "
                          "directory (config.json + model.safetensors)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(field, f"cannot read {directory / 'config.json'}: {exc}") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(kind, str) or not kind:
        raise ConfigError(field, f"{path!r}: config.json names no model_type; valid: a Hugging "
                          "Face causal LM's config.json")
    return config


def max_positions(config: dict[str, Any]) -> int | None:
    """The longest sequence the model's positions cover."""
    return config.get("n_positions") or config.get("max_position_embeddings")


def check_model_config(cfg: Any) -> int:
    """``trainmesh train --model-dir``'s rules, before any worker starts: the directory and its
    config.json (:func:`read_model_config`), no flag that the config sets or the model cannot
    run, head counts divisible by --tp, --seq-len within the positions; ``cfg`` is the
    TrainConfig. Returns the vocabulary of the data: --vocab-size, or the model's."""
    config = read_model_config(cfg.model_dir)
    p = cfg.parallel
    for flag, given in (("--layers", cfg.layers), ("--d-model", cfg.d_model), ("--heads", cfg.heads),
                        ("--init-from", cfg.init_from)):
        if given is not None:
            raise ConfigError(flag, f"is set by --model-dir ({cfg.model_dir}); valid: leave it out")
    for flag, unsupported in (("--pp", p.pp > 1), ("--sequence-parallel", p.sequence_parallel),
                              ("--strategy", p.strategy != "mesh")):
        if unsupported:
            raise ConfigError(flag, "is not supported for --model-dir models; valid: dp, tp and "
                              "ZeRO layouts (--pp 1, no --sequence-parallel, --strategy mesh)")
    heads = {"attention heads": config.get("n_head") or config.get("num_attention_heads"),
             "key/value heads": config.get("num_key_value_heads")}
    for what, count in heads.items():
        if isinstance(count, int) and count % p.tp:
            raise ConfigError("--tp", f"must divide the model's {count} {what} ({cfg.model_dir})")
    seq, longest = cfg.gpt_config().seq_len, max_positions(config)
    if isinstance(longest, int) and seq > longest:
        raise ConfigError("--seq-len", f"must be at most the model's {longest} positions; got {seq}")
    vocab = config.get("vocab_size")
    if cfg.vocab_size is not None and isinstance(vocab, int) and cfg.vocab_size > vocab:
        raise ConfigError("--vocab-size", f"the data's vocabulary must fit the model's {vocab} "
                          f"tokens; got {cfg.vocab_size}")
    return cfg.vocab_size if cfg.vocab_size is not None else vocab


def count_params(path: str) -> int:
    """Logical parameter count of the model of ``path`` (tied weights once), built on meta."""
    return sum(t.numel() for t in from_pretrained(path).parameters())


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers moves to the meta device (no storage);
    buffers stay real. Each layer's weight exists on the CPU only while it is being created."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _transformers(field: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(field, "needs the transformers package: pip install 'trainmesh[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def from_pretrained(path: str, *, field: str = FIELD) -> nn.Module:
    """The causal LM of model directory ``path`` (any ``AutoModelForCausalLM`` type), float32
    parameters on the meta device, with ``init_parameter(name, shape, index)`` reading its
    weights slice by slice (the engine calls it for what each rank holds)."""
    read_model_config(path, field)
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise ConfigError(field, f"{path!r} has no {WEIGHTS} (valid: save_pretrained output "
                          "with safetensors weights)")
    check_weights_header(weights, field)
    transformers = _transformers(field)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        with params_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(field, f"{path!r} is not a causal LM transformers can build: {first}") from None
    model.float()   # fp32 parameters whatever config.json's dtype: --precision sets the compute's
    model.init_parameter = safetensors_init(str(weights), field=field)
    return model


def check_weights_header(weights: Path, field: str = FIELD) -> None:
    """``weights`` is a readable safetensors file: its header parses and its tensors lie within
    the file (a truncated or overwritten file is refused naming ``field``, no traceback)."""
    from safetensors import safe_open
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key).get_shape()
    except Exception as exc:   # OSError, or safetensors' own SafetensorError
        raise ConfigError(field, f"cannot read {weights} as safetensors: {exc}") from None


def check_model_dir(path: str, model: nn.Module | None = None, *, field: str = FIELD,
                    tp: int = 1) -> None:
    """Every parameter of the model (built from ``path`` on meta unless given) is in
    ``model.safetensors`` with its shape, and with ``tp`` > 1 the model has a plan trainmesh
    maps (GPT-2's, or the one its config declares): checked before any worker starts."""
    from .materialize import check_safetensors
    model = model if model is not None else from_pretrained(path, field=field)
    check_safetensors(str(Path(path) / WEIGHTS), model, field=field)
    if tp > 1:
        from .tensor_parallel.hf import declared_plan, hf_model_type, hf_tp_plan
        if hf_model_type(model) != "gpt2" and declared_plan(model) is None:
            raise ConfigError("--tp", f"{type(model).__name__} declares no tensor-parallel plan "
                              "(config.base_model_tp_plan); valid for it: --tp 1 (dp and ZeRO)")
        hf_tp_plan(model)                  # a declared style trainmesh cannot map: ConfigError


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``(loss_sum, tokens)`` of a Hugging Face causal LM on a batch whose ``labels`` are the
    next tokens already (trainmesh's data): cross-entropy over every token, as the built-in GPT."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits  # (b, s, vocab)
    labels = batch["labels"]                                             # (b, s)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss, labels.numel()
