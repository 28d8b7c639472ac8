"""Sharded initialisation: a model built on the meta device gets values only where this rank
holds them, so no rank ever materialises more than its part of the model (plus one ZeRO-3 unit
in flight).

An *init function* ``init(name, shape, index) -> tensor`` returns ``full[index]`` of parameter
``name`` (its name in the whole model, ``shape`` its full shape, ``index`` one slice per
dimension): the GPT's seeded init (:func:`trainmesh.models.init.init_value`), pretrained
weights read slice by slice from a safetensors file (:func:`safetensors_init`), or the user's.
A tensor-parallel shard knows which slice it is (``_tm_full_shape``, ``_tm_tp_dim``,
``_tm_tp_start``, and ``_tm_tp_parts`` for a slice of each block of a fused projection, built
from one init call per block); anything else is whole. The engine materialises after the tensor and
pipeline split (so a stage or a TP rank builds only its own), and ZeRO-3 unit by unit, keeping
only its flat shard.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .errors import ConfigError

InitFn = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]
"""(full parameter name, full shape, one slice per dimension) -> ``full[index]``."""


def slice_of(p: nn.Parameter) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(full shape, index) of the part of its logical parameter ``p`` holds (one plain slice)."""
    shape, pieces = pieces_of(p)
    if len(pieces) != 1:
        raise ValueError("a shard of a fused projection is several slices: use pieces_of")
    return shape, pieces[0]


def pieces_of(p: nn.Parameter) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """(full shape, indices): ``p`` holds the concatenation of ``full[index]`` over the indices
    along its TP dimension — one index, or one per block of a fused projection."""
    shape = tuple(getattr(p, "_tm_full_shape", p.shape))
    if not getattr(p, "_tm_tp_sharded", False):
        return shape, [tuple(slice(0, n) for n in shape)]
    dim, start = p._tm_tp_dim, p._tm_tp_start   # type: ignore[attr-defined]
    parts = getattr(p, "_tm_tp_parts", 1)
    blocks = [shape[dim] // parts] * parts if isinstance(parts, int) else list(parts)
    n = shape[dim] // p.shape[dim]                      # the TP degree
    rank = start // (blocks[0] // n)
    pieces, offset = [], 0
    for block in blocks:                                # a fused projection: one slice per block
        width = block // n
        index = [slice(0, size) for size in shape]
        index[dim] = slice(offset + rank * width, offset + (rank + 1) * width)
        pieces.append(tuple(index))
        offset += block
    return shape, pieces


@torch.no_grad()
def materialize(named: list[tuple[str, nn.Parameter]], init: InitFn, device: torch.device) -> None:
    """Give every meta parameter of ``named`` its values from ``init``, in place."""
    for name, p in named:
        if not p.is_meta:
            continue
        shape, pieces = pieces_of(p)
        values = [init(name, shape, index) for index in pieces]
        dim = getattr(p, "_tm_tp_dim", 0)
        value = values[0] if len(values) == 1 else torch.cat(values, dim)   # a fused shard
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"init of {name}{pieces} gave shape {tuple(value.shape)}, "
                             f"expected {tuple(p.shape)}")
        real = nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
        real.__dict__.update(p.__dict__)      # attributes (``_tm_*``) travel with the swap
        torch.utils.swap_tensors(p, real)     # same object: hooks and references stay valid


def safetensors_init(path: str, *, field: str = "--init-from") -> InitFn:
    """Pretrained weights from a safetensors file (``trainmesh checkpoint consolidate`` output or
    a Hugging Face-style ``model.safetensors`` with the model's parameter names); each call reads
    only the slice asked for. A missing name or another shape: ConfigError naming ``field``."""
    from safetensors import safe_open
    handle = safe_open(path, framework="pt")

    def init(name: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> torch.Tensor:
        if name not in handle.keys():
            raise ConfigError(field, f"{path} has no tensor {name!r}")
        part = handle.get_slice(name)
        if tuple(part.get_shape()) != tuple(shape):
            raise ConfigError(field, f"{path}: {name} has shape {tuple(part.get_shape())}, "
                              f"the model's is {tuple(shape)}")
        return part[index].to(torch.float32)
    return init


def check_safetensors(path: str, model: nn.Module, *, field: str = "--init-from") -> None:
    """Every parameter of ``model`` (on meta is fine) is in the file with its shape, or
    ConfigError naming ``field``: checked before any worker starts."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:   # OSError, or safetensors' own SafetensorError
        raise ConfigError(field, f"cannot read {path} as safetensors: {exc}") from exc
    for name, p in model.named_parameters():
        if name not in shapes:
            raise ConfigError(field, f"{path} has no tensor {name!r} (valid: a file with "
                              "the model's parameter names, e.g. `trainmesh checkpoint consolidate`)")
        if shapes[name] != tuple(p.shape):
            raise ConfigError(field, f"{path}: {name} has shape {shapes[name]}, the model's "
                              f"is {tuple(p.shape)} (another --layers/--d-model/--vocab-size?)")


M_MMAP_THRESHOLD = -3     # glibc mallopt parameter


@contextlib.contextmanager
def returning_freed_memory(during: int = 1 << 20, after: int = 32 << 20) -> Iterator[None]:
    """Set-up on CPU: glibc keeps freed heap memory (ZeRO-3 builds and frees one unit after
    another), so a rank's resident peak would grow by units it no longer holds. Inside, blocks
    of ``during`` bytes and more are mmapped and go back to the system when freed; afterwards
    the threshold is ``after``, the maximum glibc's own dynamic threshold settles at. No-op
    without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, during)
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, after)
