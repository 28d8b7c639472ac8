"""A Hugging Face weights file read and written under the names the model holds in memory.

transformers 5 keeps some parameters in another form than its files: a mixture-of-experts
layer holds its experts *stacked* (Mixtral's ``mlp.experts.gate_up_proj``, ``(E, 2h, d)``,
and ``mlp.experts.down_proj``, ``(E, d, h)``), while ``save_pretrained`` writes them one expert
at a time (``block_sparse_moe.experts.{e}.w1/w3/w2.weight``; Qwen2-MoE and Qwen3-MoE
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``). transformers' own conversion mapping
(``transformers.conversion_mapping``) says how: renamings, then converters that stack the
experts (``MergeModulelist``) and join gate and up (``Concatenate``). This module applies that
mapping and nothing hand-written, both ways:

- :class:`CheckpointView` groups a file's tensors by the model parameter they make and builds one
  parameter on request (a renamed one reads only its slice; one stacked from per-expert tensors
  reads only the experts the slice takes, each whole; any other converted one is read whole,
  then sliced), or only its shape (the conversion run on meta tensors) for checks before any worker starts;
- :meth:`CheckpointView.load_buffers` sets every persistent buffer the files hold (a router's
  ``e_score_correction_bias``: trained values, saved with the weights) to the file's value, as
  transformers' ``from_pretrained`` does; each is small and read whole;
- :func:`to_file_names` turns a state dict under the model's names back into the file's form
  (transformers' ``revert_weight_conversion``, what ``save_pretrained`` writes).

A file already holding the model's names (stacked experts) is read as is. Imports core only.
"""
from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainmesh.core.errors import ConfigError

from .safetensors_file import SafetensorsError, SafetensorsFile


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """(renamings, converters) transformers applies when loading ``model``; none for a model
    transformers has no mapping for (or an older transformers without the API)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(model) if hasattr(model, "config") else []
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _natural(key: str) -> list[tuple[int, int, str]]:
    """Sort key: numbers by value (expert 10 after expert 9), as transformers orders a file;
    a number sorts before a name at the same place."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


class CheckpointView:
    """The safetensors ``files`` of a model directory (one, or the shards of its index) as the
    parameters of ``model`` (on meta is fine)."""

    def __init__(self, files: list[Path], model: nn.Module, *, field: str) -> None:
        self.path, self.field = str(files[0].parent), field
        self.handle_of: dict[str, Any] = {}
        """file key -> the file holding it (one, or the shards of an index), its header read:
        a slice maps only the rows it spans, however large the file (:mod:`.safetensors_file`)."""
        try:
            for file in files:
                handle = SafetensorsFile(file)
                self.handle_of.update((key, handle) for key in handle.keys())
        except (OSError, SafetensorsError) as exc:
            raise ConfigError(field, f"cannot read {file} as safetensors: {exc}") from None
        keys = sorted(self.handle_of, key=_natural)
        renamings, self.converters = _conversions(model)
        names = {**persistent_buffers(model), **dict(model.named_parameters())}
        self.sources: dict[str, list[tuple[str | None, str]]] = {}
        """model name -> [(converter source pattern or None, file key)], in the file's order."""
        if renamings or self.converters:
            from transformers.core_model_loading import rename_source_key
            prefix = getattr(model, "base_model_prefix", None)
            for key in keys:
                target, pattern = rename_source_key(key, renamings, self.converters, prefix, names)
                self.sources.setdefault(target, []).append((pattern, key))
        else:
            self.sources = {key: [(None, key)] for key in keys}
        for alias, canonical in tied_aliases(model).items():   # a pipeline stage holding the
            if alias not in self.sources and canonical in self.sources:   # head alone names a
                self.sources[alias] = self.sources[canonical]      # tied weight by its alias

    def _slice(self, key: str) -> Any:
        return self.handle_of[key].get_slice(key)

    def _whole(self, key: str) -> torch.Tensor:
        return self.handle_of[key].get_tensor(key)

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def _converter(self, name: str) -> Any:
        pattern = self.sources[name][0][0]
        return next(c for c in self.converters if pattern in c.source_patterns)

    def _converted(self, name: str, tensor_of: Any,
                   sources: list[tuple[str | None, str]] | None = None) -> torch.Tensor:
        """Parameter ``name`` from its file tensors (``tensor_of(key)``; ``sources``: those
        file keys only, default all) by its converter."""
        converter = deepcopy(self._converter(name))
        for pat, key in sources or self.sources[name]:
            converter.add_tensor(name, key, pat, lambda key=key: tensor_of(key))
        out = converter.convert(name)
        if name not in out:
            raise ConfigError(self.field, f"{self.path}: converting {name} gave {sorted(out)}")
        return out[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of parameter ``name`` as the file makes it (nothing read)."""
        (pattern, key), *_ = self.sources[name]
        if pattern is None:
            return tuple(self._slice(key).get_shape())
        meta = lambda key: torch.empty(self._slice(key).get_shape(), device="meta")  # noqa: E731
        return tuple(self._converted(name, meta).shape)

    def read(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        """``full[index]`` of parameter ``name``, float32; ConfigError naming the field when the
        file lacks it or makes another shape."""
        if name not in self.sources:
            raise ConfigError(self.field, f"{self.path} has no tensor for {name!r}")
        self._check_shape(name, tuple(shape))
        (pattern, key), *_ = self.sources[name]
        if pattern is None:
            return self._slice(key)[index].to(torch.float32)
        sources, index = self._experts(name, shape, index)
        return self._converted(name, self._whole, sources)[index].to(torch.float32)

    def _experts(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]
                 ) -> tuple[list[tuple[str | None, str]] | None, tuple[slice, ...]]:
        """(the file keys of the experts ``index`` spans, the index within what they make) for
        a parameter transformers stacks from per-expert tensors (``MergeModulelist`` on dim 0,
        then only operations keeping dim 0: gate and up joined, a transpose of the others) and
        an index taking a range of its experts (an expert-parallel shard): then a rank reads
        only its experts. (None, ``index``) otherwise: every source read."""
        from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose
        ops = self._converter(name).operations
        stacks = (bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
                  and all((isinstance(op, Concatenate) and op.dim != 0) or
                          (isinstance(op, Transpose) and 0 not in (op.dim0, op.dim1))
                          for op in ops[1:]))
        if not stacks or not index or not isinstance(index[0], slice) or not shape:
            return None, index
        start, stop, step = index[0].indices(shape[0])
        per_pattern: dict[str | None, list[tuple[str | None, str]]] = {}
        for source in self.sources[name]:
            per_pattern.setdefault(source[0], []).append(source)
        if step != 1 or stop <= start or any(len(v) != shape[0] for v in per_pattern.values()):
            return None, index
        return ([s for v in per_pattern.values() for s in v[start:stop]],
                (slice(None), *index[1:]))

    def check(self, model: nn.Module) -> None:
        """Every parameter of ``model`` is in the file with its shape, and every persistent
        buffer the file holds has its shape, or ConfigError."""
        for name, p in model.named_parameters():
            if name not in self.sources:
                raise ConfigError(self.field, f"{self.path} has no tensor for {name!r} (valid: "
                                  "a save_pretrained directory of this model)")
            self._check_shape(name, tuple(p.shape))
        for name, b in persistent_buffers(model).items():
            if name in self.sources:
                self._check_shape(name, tuple(b.shape))

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if self.shape(name) != shape:
            raise ConfigError(self.field, f"{self.path}: {name} has shape {self.shape(name)}, "
                              f"the model's is {shape}")

    @torch.no_grad()
    def load_buffers(self, model: nn.Module) -> list[str]:
        """Every real persistent buffer of ``model`` the files hold takes the file's value
        (whole, in the buffer's dtype; a buffer the files lack keeps what the model's init gave
        it, as in transformers' ``from_pretrained``); returns the names loaded."""
        loaded = []
        for name, b in persistent_buffers(model).items():
            if name in self.sources and not b.is_meta:
                self._check_shape(name, tuple(b.shape))
                (pattern, key), *_ = self.sources[name]
                b.copy_(self._whole(key) if pattern is None else self._converted(name, self._whole))
                loaded.append(name)
        return loaded


def file_state(hf_config: dict[str, Any], state: dict[str, torch.Tensor], *, field: str
               ) -> dict[str, torch.Tensor]:
    """``state`` (names held in memory) of the model ``hf_config`` (a config.json as a dict)
    describes, in the form its ``save_pretrained`` writes; ConfigError naming ``field`` when
    transformers cannot build that model."""
    from trainmesh.models.hf import meta_model, transformers_module
    transformers = transformers_module(field)
    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
        model = meta_model(transformers, config, buffers=False)    # names alone: wholly on meta
    except (ValueError, KeyError) as exc:
        raise ConfigError(field, f"transformers cannot build the recorded "
                          f"{hf_config.get('model_type')!r} model: {exc}") from None
    return to_file_names(model, state)


def to_file_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's names) in the form ``save_pretrained`` writes for ``model``'s
    type: experts one by one where transformers stores them so."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:     # a transformers without conversions stores what it holds
        return state
    return revert_weight_conversion(model, state)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of every buffer ``model``'s state dict holds (saved with the weights),
    under each name a shared one has."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                out[f"{prefix}.{leaf}" if prefix else leaf] = b
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Every other name of a parameter the model shares under several (tied embeddings:
    ``lm_head.weight``) -> its first name (the one ``save_pretrained`` writes)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out
