"""A Hugging Face model directory cut to its first N decoder layers (``trainmesh verify --layers``).

The cut directory is the original with ``config.json``'s layer count set to N (and every
per-layer list of the config, such as ``layer_types``, cut to its first N entries), the weights
of the layers from N on left out of ``model.safetensors``, and every other file (tokenizer,
generation config) copied. The decoder layer list is the one the model's pipeline plan names
(:func:`trainmesh.core.hf_plan.hf_structure`), or else its only ``nn.ModuleList`` as long as the
layer count. The cut model is the original's embeddings, first N layers, final norm and head,
with the original's weights. Imports core and models only.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.models.hf import INDEX, WEIGHTS, build_on_meta, read_model_config, weight_files

FLAG = "--layers"
LAYER_COUNT = "num_hidden_layers"
"""transformers' common name of a config's layer count (a family may spell it otherwise in
config.json: GPT-2's ``n_layer``, through its config class's ``attribute_map``)."""


def layer_list(model: nn.Module) -> str:
    """The name of ``model``'s decoder layer list (``model.layers``)."""
    from trainmesh.core.hf_plan import family, hf_structure
    try:
        return hf_structure(model, FLAG).layers
    except ConfigError:
        pass   # no usable pipeline plan: the one module list as long as the layer count
    count = getattr(model.config, LAYER_COUNT, None)
    lists = [name for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        raise ConfigError(FLAG, f"cannot tell the {family(model)} model's decoder layer list "
                          f"(module lists of {count} entries: {lists}); valid: leave --layers out")
    return lists[0]


def layer_count_key(model: nn.Module, config: dict) -> str:
    """The key of ``config.json`` that holds the layer count."""
    key = getattr(type(model.config), "attribute_map", {}).get(LAYER_COUNT, LAYER_COUNT)
    if not isinstance(config.get(key), int):
        raise ConfigError(FLAG, f"config.json has no integer {key!r} (the layer count); valid: "
                          "leave --layers out")
    return key


def cut_config(config: dict, key: str, layers: int) -> dict:
    """``config`` with ``layers`` decoder layers: its count, and each list as long as the
    original count (one entry per layer) cut to its first ``layers`` entries."""
    total = config[key]
    out = {k: v[:layers] if isinstance(v, list) and len(v) == total and k != key else v
           for k, v in config.items()}
    out[key] = layers
    return out


def kept(name: str, prefix: str, layers: int) -> bool:
    """Whether the weights file's tensor ``name`` belongs to the cut model: not a tensor of a
    layer ``layers`` or later of the list ``prefix``."""
    match = re.match(re.escape(prefix) + r"\.(\d+)\.", name)
    return match is None or int(match.group(1)) < layers


def cut_model_dir(path: str, layers: int, out: Path) -> int:
    """Write ``path``'s model cut to its first ``layers`` decoder layers into the directory
    ``out`` (created); return the original's layer count. ConfigError naming ``--layers``
    when ``layers`` exceeds it or the layer list cannot be found."""
    from safetensors.torch import save_file

    from trainmesh.models.safetensors_file import SafetensorsFile
    model = build_on_meta(path, buffers=False)     # names alone: wholly on meta
    config = read_model_config(path)
    key = layer_count_key(model, config)
    total = config[key]
    if not 1 <= layers <= total:
        raise ConfigError(FLAG, f"the model of {path} has {total} decoder layers; valid: 1..{total}")
    prefix = layer_list(model)
    out.mkdir(parents=True, exist_ok=True)
    files = weight_files(path)
    for item in Path(path).iterdir():   # tokenizer, generation config, ...: as they are
        if item.is_file() and item.name not in ("config.json", WEIGHTS, INDEX) \
                and item not in files:
            shutil.copy2(item, out / item.name)
    (out / "config.json").write_text(json.dumps(cut_config(config, key, layers), indent=2))
    tensors = {}
    for file in files:
        f = SafetensorsFile(file)         # the kept tensors' bytes only, never the whole file
        tensors.update({name: f.get_tensor(name) for name in f.keys() if kept(name, prefix, layers)})
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    return total
