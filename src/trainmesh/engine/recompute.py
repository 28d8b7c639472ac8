"""Activation recomputation: keep fewer activations in forward, recompute them in backward.

- ``full``: keep each layer's input only; backward re-runs the layer from it. With segment K,
  keep the input of every K-th layer and re-run K layers from it (K=2 keeps the inputs of
  layers 0, 2, 4, ...).
- ``selective``: recompute only the attention internals (Megatron's selective recomputation):
  every module's ``core(q, k, v)`` method — the built-in GPT's ``Attention.core`` —, or a
  Hugging Face model's attention call (the function its attention interface names: sdpa,
  eager, context parallelism's ring, :func:`_selective_hf`).

All of it is ``torch.utils.checkpoint`` (non-reentrant), applied in place without renaming any
parameter: a layer's ``forward`` (or ``core``) becomes an instance attribute, a
:class:`Recomputed` holding the original; the built-in GPT's segments replace
``model.run_blocks``, an ``nn.Sequential``'s its ``forward`` (a :class:`Segmented`). The layers are found as the built-in GPT's ``blocks``, the children of an
``nn.Sequential`` (or a list of modules), or the first ``ModuleList``/``Sequential`` attribute
named ``blocks``, ``layers`` or ``h`` (HF GPT-2) anywhere in the model. Segments > 1 need a
loop trainmesh runs (GPT, ``nn.Sequential``); run them elsewhere with :func:`run_segments`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainmesh.core.errors import ConfigError

LAYER_LIST_NAMES = ("blocks", "layers", "h")


def apply_recompute(model: nn.Module | Sequence[nn.Module], mode: str, *, segment: int = 1) -> None:
    """Make ``model`` recompute activations in backward according to ``mode``."""
    if segment < 1:
        raise ConfigError("recompute-segment", f"must be a positive integer; got {segment}")
    if mode == "none":
        return
    if mode == "selective":
        _selective(model)
    elif mode == "full":
        _full(model, segment)
    else:
        raise ConfigError("recompute", f"must be one of none, full, selective; got {mode!r}")


def run_segments(layers: Sequence[nn.Module], x: Any, segment: int, *extra: Any) -> Any:
    """``x`` through ``layers`` in order, keeping for backward only each segment's input;
    ``extra`` arguments go to every layer (a packed batch's position ids)."""
    if not torch.is_grad_enabled():
        return _run_layers(layers, x, *extra)
    for i in range(0, len(layers), segment):
        x = checkpoint(partial(_run_layers, layers[i : i + segment]), x, *extra, use_reentrant=False)
    return x


def _run_layers(layers: Sequence[nn.Module], x: Any, *extra: Any) -> Any:
    for layer in layers:
        x = layer(x, *extra)
    return x


# ---------------------------------------------------------------- in-place wrappers
class Recomputed:
    """A module's method replaced by a checkpoint of the original ``inner`` (a bound method),
    set as an instance attribute; a copy of the module (``deepcopy``) rebinds ``inner``."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class Segmented:
    """``x`` through ``layers`` keeping only every ``segment``-th layer's input (an instance
    attribute replacing the GPT's ``run_blocks`` or an ``nn.Sequential``'s ``forward``)."""

    def __init__(self, layers: nn.Module, segment: int) -> None:
        self.layers, self.segment = layers, segment

    def __call__(self, x: Any, *extra: Any) -> Any:
        return run_segments(list(self.layers), x, self.segment, *extra)


def _wrap(module: nn.Module, method: str) -> None:
    """Replace ``module.<method>`` by a checkpoint of itself (once)."""
    if isinstance(module.__dict__.get(method), Recomputed):
        return
    module.__dict__[method] = Recomputed(getattr(module, method))


# ---------------------------------------------------------------- modes
def _full(model: nn.Module | Sequence[nn.Module], segment: int) -> None:
    if isinstance(model, nn.Module) and callable(getattr(model, "run_blocks", None)) \
            and isinstance(getattr(model, "blocks", None), nn.ModuleList):   # the built-in GPT
        if segment > 1:
            model.__dict__["run_blocks"] = Segmented(model.blocks, segment)
            return
        layers: Sequence[nn.Module] = list(model.blocks)
    elif isinstance(model, nn.Sequential):
        if segment > 1:
            if not isinstance(model.__dict__.get("forward"), Segmented):
                model.__dict__["forward"] = Segmented(model, segment)
            return
        layers = list(model)
    else:
        if isinstance(model, (list, tuple)):
            path, layers = "the list", list(model)
        else:
            found = _find_layer_list(model)
            if found is None:
                raise ConfigError("recompute", f"full recompute needs the model's layers: the built-in "
                                  f"GPT, an nn.Sequential, or a ModuleList attribute named "
                                  f"{'/'.join(LAYER_LIST_NAMES)}; none found in {type(model).__name__}")
            path, layers = found[0], list(found[1])
        if segment > 1:
            raise ConfigError("recompute-segment", f"> 1 needs a loop trainmesh runs (the built-in GPT "
                              f"or an nn.Sequential); the layers of {path!r} are run by the model's own "
                              "code: use --recompute-segment 1")
    # Keep each layer's input: the layer's own forward becomes a checkpoint of itself.
    # (The layers stay ordinary submodules: hooks and parameter names are untouched.)
    for layer in layers:
        _wrap(layer, "forward")


def _find_layer_list(model: nn.Module) -> tuple[str, nn.Module] | None:
    for name, m in model.named_modules():
        for attr in LAYER_LIST_NAMES:
            layers = getattr(m, attr, None)
            if isinstance(layers, (nn.ModuleList, nn.Sequential)) and len(layers) > 0:
                return (f"{name}.{attr}" if name else attr), layers
    return None


def _selective(model: nn.Module | Sequence[nn.Module]) -> None:
    modules = [m for layer in (model if isinstance(model, (list, tuple)) else [model])
               for m in layer.modules()]
    targets = [m for m in modules if callable(getattr(m, "core", None))]
    if not targets and isinstance(model, nn.Module) and _selective_hf(model):
        return
    if not targets:
        name = type(model).__name__
        raise ConfigError("recompute", f"selective recompute checkpoints attention internals: modules "
                          f"with a core(q, k, v) method (the built-in GPT's Attention) or the attention "
                          f"call of a Hugging Face model; none in {name}. Use --recompute full")
    for m in targets:
        _wrap(m, "core")


RECOMPUTED = "trainmesh_recompute:"
"""Prefix of the attention implementation that checkpoints another (a Hugging Face model's)."""


def _selective_hf(model: nn.Module) -> bool:
    """A Hugging Face model whose attention goes through transformers' attention interface
    calls a checkpoint of the implementation it called (sdpa, eager, context parallelism's
    ring), its masks built as before; False for any other model."""
    from trainmesh.models.hf_attention import current, implementation, routes_attention, use_attention
    if not routes_attention(model):
        return False
    inner = current(model)
    if inner.startswith(RECOMPUTED):
        return True

    def recomputed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        fn = implementation(inner, module)
        if not torch.is_grad_enabled():
            return fn(module, *args, **kwargs)
        return checkpoint(fn, module, *args, use_reentrant=False, **kwargs)

    use_attention(model, RECOMPUTED + inner, recomputed, mask_like=inner)
    return True
