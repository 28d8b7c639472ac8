"""A Hugging Face model's attention call, through transformers' attention interface.

transformers 5 models call attention through ``ALL_ATTENTION_FUNCTIONS.get_interface(
config._attn_implementation, eager_attention_forward)``: a function ``(module, query, key,
value, attention_mask, *, scaling, dropout, **kwargs) -> (output (b, s, h, hd), weights)``
looked up by name, where new implementations can be registered (``AttentionInterface.
register``); ``masking_utils`` builds the mask for a name it knows (``AttentionMaskInterface``)
and none for another. :func:`use_attention` registers a function under a name and points every
config of the model at it (the model's, its sub-configs', and the copies tensor parallelism
gives attention modules with their local head counts). :func:`implementation` is what a model
calls now, so a wrapper (selective recomputation) can call it in turn.

:func:`routes_attention` says whether a family's attention goes through the interface at all
(its modeling code calls ``get_interface``). Imports core only.
"""
from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

AttentionFn = Callable[..., Any]
"""``(module, query, key, value, attention_mask, **kwargs) -> (output, weights)``."""


def configs_of(model: nn.Module) -> list[Any]:
    """Every distinct Hugging Face config the model's modules hold, the model's first."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen[id(config)] = config
    return list(seen.values())


def current(model: nn.Module) -> str:
    """The name of the attention implementation the model calls (``sdpa``, ``eager``, ...)."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return name or "eager"


def routes_attention(model: nn.Module) -> bool:
    """Whether the model's attention is looked up in transformers' attention interface: its
    modeling code calls ``ALL_ATTENTION_FUNCTIONS.get_interface`` (the test transformers
    applies before it lets an implementation be set, here without its benefit of the doubt for
    a module that has no attention class)."""
    module = sys.modules.get(type(model).__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS.get_interface(" in source


def implementation(name: str, module: nn.Module) -> AttentionFn:
    """The function registered as ``name``; ``eager``: the family's own
    ``eager_attention_forward`` (the default its attention module falls back to)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if name == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise KeyError(f"{type(module).__name__}'s module defines no eager_attention_forward")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def use_attention(model: nn.Module, name: str, fn: AttentionFn, *, mask_like: str | None = None) -> None:
    """Register ``fn`` as attention implementation ``name`` and make every config of ``model``
    call it. ``mask_like``: masks built as for that implementation (``sdpa``, ``eager``); None:
    no mask (``fn`` masks by itself)."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register(name, fn)
    if mask_like is not None and mask_like in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_like])
    for config in configs_of(model):
        config._attn_implementation = name        # the setter reaches its sub-configs
