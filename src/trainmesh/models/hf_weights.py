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
  parameter on request, reading only what the slice takes: a renamed one its slice; a converted
  one the parts of its file tensors the slice maps back to through the converter's operations
  (stacked experts: the slice's experts, of each only its rows and columns, gate and up
  alike), the operations run on those parts; one whose operations cannot be mapped back is
  read whole, converted, then sliced. Or only its shape (the conversion run on meta tensors)
  for checks before any worker starts;
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

from .safetensors_file import SafetensorsError, SafetensorsFile, box_of


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


class _Held:
    """What a conversion may ask of the model it loads (``model.get_parameter(name)``: the
    shape or dtype of a parameter or buffer) on meta tensors, so that the reader keeps
    nothing of the model itself."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.of = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
                   for name, t in tensors.items()}

    def get_parameter(self, name: str) -> torch.Tensor:
        if name not in self.of:
            raise AttributeError(f"the model has no parameter {name!r}")
        return self.of[name]


class CheckpointView:
    """The safetensors ``files`` of a model directory (one, or the shards of its index) as the
    parameters of ``model`` (on meta is fine)."""

    def __init__(self, files: list[Path], model: nn.Module, *, field: str) -> None:
        self.path, self.field = str(files[0].parent), field
        self.handle_of: dict[str, Any] = {}
        """file key -> the file holding it (one, or the shards of an index), its header read:
        a slice reads only the bytes it spans, however large the file (:mod:`.safetensors_file`)."""
        try:
            for file in files:
                handle = SafetensorsFile(file)
                self.handle_of.update((key, handle) for key in handle.keys())
        except (OSError, SafetensorsError) as exc:
            raise ConfigError(field, f"cannot read {file} as safetensors: {exc}") from None
        keys = sorted(self.handle_of, key=_natural)
        renamings, self.converters = _conversions(model)
        names = {**persistent_buffers(model), **dict(model.named_parameters())}
        self.held = _Held({**names, **dict(model.named_parameters(remove_duplicate=False))})
        self.config = getattr(model, "config", None)
        self.sources: dict[str, list[tuple[str | None, str]]] = {}
        """model name -> [(converter source pattern or None, file key)], in the file's order."""
        self.layer_of: dict[str, str] = {}
        """model name -> the name its converter runs under, where one converter makes several
        parameters (a fused file tensor ``Chunk``-ed or ``Split`` into q, k and v)."""
        if renamings or self.converters:
            from transformers.core_model_loading import rename_source_key
            prefix = getattr(model, "base_model_prefix", None)
            for key in keys:
                target, pattern = rename_source_key(key, renamings, self.converters, prefix, names)
                if target not in names and key in names:   # as transformers: a renaming that
                    target, pattern = rename_source_key(key, [], [], prefix, names)  # misses
                self.sources.setdefault(target, []).append((pattern, key))
            self._add_other_targets(names)
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

    def _add_other_targets(self, names: dict[str, torch.Tensor]) -> None:
        """Every other parameter a converter with several targets makes from the file tensors
        collected under its first (transformers names them after the first): read through it."""
        for name, group in list(self.sources.items()):
            if group[0][0] is None or len(self._converter(name).target_patterns) == 1:
                continue
            for other in self._converted(name, self._meta, every=True):
                if other != name and other in names and other not in self.sources:
                    self.sources[other], self.layer_of[other] = group, name

    def _meta(self, key: str) -> torch.Tensor:
        return torch.empty(self._slice(key).get_shape(), device="meta")

    def _converted(self, name: str, tensor_of: Any,
                   sources: list[tuple[str | None, str]] | None = None,
                   operations: list[Any] | None = None, every: bool = False) -> Any:
        """Parameter ``name`` from its file tensors (``tensor_of(key)``; ``sources``: those
        file keys only, default all) by its converter (``operations``: these instead of its
        own), given what an operation may ask of the model (a parameter's shape: a
        shape-checking ``Transpose``, a ``Split``; the config: a ``Chunk`` into as many parts as
        it says); ``every``: the dict of all it makes."""
        layer = self.layer_of.get(name, name)
        converter = deepcopy(self._converter(name))
        if operations is not None:
            converter.operations = operations
        for pat, key in sources or self.sources[name]:
            converter.add_tensor(layer, key, pat, lambda key=key: tensor_of(key))
        out = converter.convert(layer, model=self.held, config=self.config)
        if every:
            return out
        if name not in out:
            raise ConfigError(self.field, f"{self.path}: converting {name} gave {sorted(out)}")
        return out[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The full shape of parameter ``name`` as the file makes it (nothing read)."""
        (pattern, key), *_ = self.sources[name]
        if pattern is None:
            return tuple(self._slice(key).get_shape())
        return tuple(self._converted(name, self._meta).shape)

    def read(self, name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        """``full[index]`` of parameter ``name``, float32; ConfigError naming the field when the
        file lacks it or makes another shape. A converted parameter reads only the parts of
        its file tensors that ``index`` takes (:meth:`_parts`), else every one whole."""
        if name not in self.sources:
            raise ConfigError(self.field, f"{self.path} has no tensor for {name!r}")
        self._check_shape(name, tuple(shape))
        (pattern, key), *_ = self.sources[name]
        if pattern is None:
            return self._slice(key)[index].to(torch.float32)
        box, post = box_of(tuple(shape), index)
        if any(lo == hi for lo, hi in box):            # nothing to read
            return torch.empty([hi - lo for lo, hi in box])[post]
        parts = self._parts(name, box)
        if parts is None:                               # an operation not mapped: whole
            return self._converted(name, self._whole)[index].to(torch.float32)
        sources, index_of, operations = parts
        if operations:
            value = self._converted(name, lambda key: self._slice(key)[index_of[key]], sources,
                                    operations)
        else:                                           # every operation left out: a plain read
            (_, key), = sources
            value = self._slice(key)[index_of[key]]
        return (value if post == () else value[post]).to(torch.float32)

    def _parts(self, name: str, box: list[tuple[int, int]]
               ) -> tuple[list[tuple[str | None, str]], dict[str, tuple[slice, ...]], list[Any]
                          ] | None:
        """(the file keys to read, key -> the index of it to read, the operations to run on
        those parts) such that they make ``full[box]`` of parameter ``name`` (one range per
        dimension), the converter's operations mapped back from the box to the files:
        ``MergeModulelist`` on dim 0 (experts stacked from per-expert tensors: the box's
        experts, each its box's rows and columns), ``Concatenate`` (a range of the joined
        dimension is a range of each part it meets, maybe empty: gate and up, a range spanning
        both or packed halves alike) and ``Transpose`` (the two dimensions' ranges swapped), in
        the order the converter runs them. A ``Transpose`` that checks the model's shape
        (Qwen3-VL-MoE's experts) is decided here, on the whole shapes, as transformers decides
        it on the whole tensor: left out where the tensor has the parameter's shape already,
        else a plain ``Transpose`` (it would decide otherwise on a part). None (every source
        then read whole and converted) for any other operation: an interleave, a merge on
        another dimension or stacked experts joined on theirs, a split; or for sources whose
        shapes do not fit."""
        from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose
        converter = self._converter(name)
        ops, patterns = list(converter.operations), list(converter.source_patterns)
        keys: dict[str | None, list[str]] = {}
        for pattern, key in self.sources[name]:
            keys.setdefault(pattern, []).append(key)
        stacked = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        if set(keys) != set(patterns) or not (stacked or all(len(k) == 1 for k in keys.values())):
            return None
        shapes = {}                                     # per pattern: the tensor the ops take
        for pattern in patterns:
            each = {tuple(self._slice(key).get_shape()) for key in keys[pattern]}
            if len(each) != 1:
                return None
            shapes[pattern] = (len(keys[pattern]), *each.pop()) if stacked else each.pop()
        seen: list[tuple[Any, list[tuple[int, ...]]]] = []   # each op with its inputs' shapes
        for op in ops[stacked:]:
            now = list(shapes.values())
            if isinstance(op, Transpose) and getattr(op, "check_dims", False) and len(now) == 1:
                held = self.held.get_parameter(self.layer_of.get(name, name))
                if now[0] == tuple(held.shape):         # transformers leaves it as it is
                    continue
                op = Transpose(op.dim0, op.dim1)        # transformers transposes it
            if isinstance(op, Concatenate) and not (stacked and op.dim == 0) and all(
                    len(s) == len(now[0]) and s[:op.dim] + s[op.dim + 1:] ==
                    now[0][:op.dim] + now[0][op.dim + 1:] for s in now):
                joined = list(now[0])
                joined[op.dim] = sum(s[op.dim] for s in now)
                shapes = {None: tuple(joined)}
            elif isinstance(op, Transpose) and not getattr(op, "check_dims", False) \
                    and len(shapes) == 1:
                (only, s), = shapes.items()
                s = list(s)
                s[op.dim0], s[op.dim1] = s[op.dim1], s[op.dim0]
                shapes = {only: tuple(s)}
            else:
                return None
            seen.append((op, now))
        if len(shapes) != 1 or len(next(iter(shapes.values()))) != len(box):
            return None
        boxes = [list(box)]                             # per input of the op, back to the files
        for op, now in reversed(seen):
            if isinstance(op, Transpose):
                boxes[0][op.dim0], boxes[0][op.dim1] = boxes[0][op.dim1], boxes[0][op.dim0]
                continue
            (lo, hi), offset, split = boxes[0][op.dim], 0, []
            for s in now:                               # each input's part of the joined range
                part = list(boxes[0])
                first = min(max(lo - offset, 0), s[op.dim])
                part[op.dim] = (first, max(first, min(hi - offset, s[op.dim])))
                split.append(part)
                offset += s[op.dim]
            boxes = split
        sources, index_of = [], {}
        for pattern, part in zip(patterns, boxes):
            (lo, hi), rest = part[0], tuple(slice(a, z) for a, z in part)
            for key in keys[pattern][lo:hi] if stacked else keys[pattern]:
                sources.append((pattern, key))
                index_of[key] = rest[1:] if stacked else rest
        return sources, index_of, ops[:stacked] + [op for op, _ in seen]

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
