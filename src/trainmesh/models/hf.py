"""Hugging Face model directories as models: ``config.json`` read and checked, the model built
from it with every parameter on the meta device, the weights file's header checked.

transformers is an optional dependency (``pip install 'trainmesh[hf]'``), imported only when a
model is built. Filling the parameters slice by slice is the engine's
(:func:`trainmesh.engine.pretrained.from_pretrained`). Imports core only.
"""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError

from .hf_plans import PlanFiles, install_plans

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
"""A sharded directory's index (``save_pretrained`` above ``max_shard_size``): tensor -> file."""
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


EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""config.json fields that count a mixture-of-experts layer's experts (Mixtral; Qwen-MoE;
DeepSeek; Ernie 4.5)."""


def n_experts(config: dict[str, Any]) -> int:
    """Experts per mixture-of-experts layer of a model's config.json (0: a dense model)."""
    for key in EXPERT_COUNTS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return 0


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers moves to the meta device (no storage);
    buffers stay real. Each parameter is first made on the CPU (its pages untouched, but a
    stacked-experts tensor of tens of GB is still an allocation the host may refuse): for a
    module built outside transformers. A hub model is built by :func:`meta_model`."""
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


def meta_model(transformers: Any, config: Any, *, buffers: bool = True) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` built as transformers' own ``from_pretrained``
    builds it: every tensor made on the meta device (no parameter ever has storage, however
    large: DeepSeek-V3's stacked experts are 30 GB a layer). ``buffers``: then each meta buffer
    (rotary frequencies, a router's correction bias) made real as ``from_pretrained`` makes it:
    a placeholder on the CPU that the model's own ``_init_weights`` fills. What this costs grows
    with the buffers (what every rank holds whole anyway), never with the parameters. A model
    whose ``_init_weights`` leaves a buffer unfilled (Apertus's and Falcon-H1's in transformers
    5.25) is built as before instead (:func:`params_on_meta`: its buffers as its constructor
    makes them)."""
    build = transformers.AutoModelForCausalLM.from_config
    safe = getattr(getattr(transformers, "initialization", None), "meta_device_safe_creation_ops",
                   contextlib.nullcontext)
    with torch.device("meta"), safe(), params_on_meta():  # (a parameter made with an explicit
        model = build(config)                               # device, DiffLlama's lambdas: moved)
    if buffers and not _fill_buffers(model, transformers):
        with params_on_meta():
            model = build(config)
    return model


@torch.no_grad()
def _fill_buffers(model: nn.Module, transformers: Any) -> bool:
    """Every meta buffer of ``model`` real, filled by the ``_init_weights`` of the transformers
    model that holds it (a sub-model's own); False when one (not a boolean one) is left
    unfilled."""
    pretrained = transformers.PreTrainedModel
    guard = getattr(getattr(transformers, "initialization", None), "guard_torch_init_functions",
                    contextlib.nullcontext)

    made: dict[int, torch.Tensor] = {}    # a buffer shared by modules stays one tensor

    def walk(module: nn.Module, owner: Any) -> bool:
        owner = module if isinstance(module, pretrained) else owner
        if not all(walk(child, owner) for child in module.children()):
            return False
        meta = {name: b for name, b in module._buffers.items() if b is not None and b.is_meta}
        fresh = [name for name, b in meta.items() if id(b) not in made]
        for name, b in meta.items():
            module._buffers[name] = made.setdefault(id(b), torch.full_like(b, _unfilled(b.dtype),
                                                                           device="cpu"))
        if fresh:
            owner._init_weights(module)
        return not any((module._buffers[name] == _unfilled(b.dtype)).any()
                       or module._buffers[name].isnan().any() for name, b in meta.items()
                       if name in fresh and b.dtype != torch.bool)

    with guard():
        return walk(model, model)


def _unfilled(dtype: torch.dtype) -> float | int | bool:
    """A buffer's placeholder, no value an init gives: NaN, an integer type's least value."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def transformers_module(field: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(field, "needs the transformers package: pip install 'trainmesh[hf]'") from None
    from trainmesh.core.versions import check_transformers
    check_transformers(transformers)
    transformers.logging.set_verbosity_error()
    return transformers


def build_on_meta(path: str, *, field: str = FIELD, plans: PlanFiles | None = None,
                  weights: bool = True, buffers: bool = True) -> nn.Module:
    """The causal LM of model directory ``path`` (any ``AutoModelForCausalLM`` type), float32
    parameters on the meta device (buffers real; without ``buffers``, for shapes alone, on meta
    too: :func:`meta_model`), its parallel plans installed (``plans``' files, else its
    declared ones, else inferred: :mod:`.hf_plans`); ConfigError naming
    ``field`` when the directory, its config or (``weights``: the planner reads config.json
    alone) its weights file cannot make one, or naming a plan file's flag when that file
    cannot be used."""
    read_model_config(path, field)
    for file in weight_files(path, field) if weights else []:
        check_weights_header(file, field)
    transformers = transformers_module(field)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        model = meta_model(transformers, config, buffers=buffers)
    except (ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(field, f"{path!r} is not a causal LM transformers can build: {first}") from None
    # fp32 parameters whatever config.json's dtype: --precision sets the compute's
    return install_plans(model.float(), plans)


def weight_files(path: str, field: str = FIELD) -> list[Path]:
    """The safetensors files of model directory ``path``: ``model.safetensors``, or the shards
    ``model.safetensors.index.json`` names (in name order); ConfigError naming ``field`` when
    there are none or the index names a file that is not in the directory."""
    directory = Path(path)
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    index = directory / INDEX
    if not index.is_file():
        raise ConfigError(field, f"{path!r} has no {WEIGHTS} nor {INDEX} (valid: save_pretrained "
                          "output with safetensors weights)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(field, f"cannot read {index} (a weight_map of tensor -> file): {exc!r}") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
            raise ConfigError(field, f"{index} names {name!r}, not a file of {path!r}")
    return [directory / name for name in names]


def count_params(path: str) -> int:
    """Logical parameter count of the model of ``path`` (tied weights once), built wholly on
    meta from its config.json (no buffer made, no weights file read)."""
    return sum(t.numel() for t in build_on_meta(path, weights=False, buffers=False).parameters())


def check_weights_header(weights: Path, field: str = FIELD) -> None:
    """``weights`` is a readable safetensors file: its header parses and its tensors lie within
    the file (a truncated or overwritten file is refused naming ``field``, no traceback). Only
    the header is read, so a shard of any size is checked (nothing of it is mapped)."""
    from .safetensors_file import SafetensorsError, read_header
    try:
        read_header(weights)
    except (OSError, SafetensorsError) as exc:
        raise ConfigError(field, f"cannot read {weights} as safetensors: {exc}") from None
