"""Sharded initialisation: a model built on the meta device gets values only where this rank
holds them, so no rank ever materialises more than its part of the model (plus one ZeRO-3 unit
in flight).

An *init function* ``init(name, shape, index) -> tensor`` returns ``full[index]`` of parameter
``name`` (its name in the whole model, ``shape`` its full shape, ``index`` one slice per
dimension): the GPT's seeded init (:func:`trainmesh.models.init.init_value`), pretrained
weights read slice by slice from a safetensors file (:func:`safetensors_init`), or the user's.
Which slice a tensor-parallel shard is comes from its record in the engine's
:class:`~trainmesh.core.placement.Placements` (by name: full shape, ``tp_dim``, ``tp_start``, and
``tp_parts`` for a slice of each block of a fused projection, built from one init call per
block); a parameter without a record is whole. The records are keyed by name, so they stay
valid when the real parameter replaces the meta one. The engine materialises after the tensor and
pipeline split (so a stage or a TP rank builds only its own), and ZeRO-3 unit by unit, keeping
only its flat shard. Frozen parameters (``requires_grad=False``) are materialised whole (or as
their TP slice) on every rank at every ZeRO stage, as is every meta buffer
(:func:`materialize_buffers`, from the same init function, whole).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch
from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hub_state import InitFn
from trainmesh.core.placement import Placement, Placements


def slice_of(p: nn.Parameter, placement: Placement | None
             ) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """(full shape, index) of the part of its logical parameter ``p`` holds (one plain slice)."""
    shape, pieces = pieces_of(p, placement)
    if len(pieces) != 1:
        raise ValueError("a shard of a fused projection is several slices: use pieces_of")
    return shape, pieces[0]


def pieces_of(p: nn.Parameter, placement: Placement | None
              ) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """(full shape, indices): ``p``, placed as ``placement`` says (None: whole), holds the
    concatenation of ``full[index]`` over the indices along its TP dimension — one index, or
    one per block of a fused projection."""
    placement = placement or Placement(full_shape=tuple(p.shape))
    return placement.full_shape, placement.pieces(tuple(p.shape))


@torch.no_grad()
def materialize(named: list[tuple[str, nn.Parameter]], init: InitFn, device: torch.device,
                placements: Placements | None = None) -> None:
    """Give every meta parameter of ``named`` its values from ``init``, in place
    (``placements``: which slice each holds; a name without a record is whole)."""
    for name, p in named:
        if not p.is_meta:
            continue
        placement = placements.get(name) if placements is not None else None
        shape, pieces = pieces_of(p, placement)
        values = [init(name, shape, index) for index in pieces]
        dim = placement.tp_dim if placement is not None and placement.tp_dim is not None else 0
        value = values[0] if len(values) == 1 else torch.cat(values, dim)   # a fused shard
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"init of {name}{pieces} gave shape {tuple(value.shape)}, "
                             f"expected {tuple(p.shape)}")
        real = nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
        real.__dict__.update(p.__dict__)      # the user's attributes travel with the swap
        torch.utils.swap_tensors(p, real)     # same object: hooks and references stay valid


@torch.no_grad()
def materialize_buffers(module: nn.Module, init: InitFn, device: torch.device) -> None:
    """Give every meta buffer of ``module`` its whole value from ``init`` (by its name in
    ``module``; a buffer shared by several modules once), in place of the meta one."""
    made: dict[int, torch.Tensor] = {}
    for name, b in list(module.named_buffers(remove_duplicate=False)):
        if b is None or not b.is_meta:
            continue
        if id(b) not in made:
            shape = tuple(b.shape)
            value = init(name, shape, tuple(slice(None) for _ in shape))
            if tuple(value.shape) != shape:
                raise ValueError(f"init of buffer {name} gave shape {tuple(value.shape)}, "
                                 f"expected {shape}")
            made[id(b)] = value.to(device=device, dtype=b.dtype)
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[leaf] = made[id(b)]    # keeps the buffer's persistence


def safetensors_init(path: str, *, field: str = "--init-from") -> InitFn:
    """Pretrained weights from a safetensors file (``trainmesh checkpoint consolidate`` output or
    a Hugging Face-style ``model.safetensors`` with the model's parameter names); each call reads
    only the slice asked for. A missing name or another shape: ConfigError naming ``field``."""
    from trainmesh.models.safetensors_file import SafetensorsFile
    handle = SafetensorsFile(path)        # the header, then only the bytes each slice spans

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
    from trainmesh.models.safetensors_file import read_header
    try:
        shapes = {k: tuple(e["shape"]) for k, e in read_header(path)[0].items()}
    except Exception as exc:   # OSError, or a header that is not safetensors' (SafetensorsError)
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
