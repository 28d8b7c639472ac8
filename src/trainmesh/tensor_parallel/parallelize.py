"""``parallelize``: apply a tensor-parallel plan to a built model, in place.

Layer styles replace a child module by its parallel counterpart built from it (same attribute
names ``weight``/``bias``, so parameter names do not change); the other styles install forward
hooks, and, under sequence parallelism, gradient hooks that all-reduce over tp the partial
gradients of replicated parameters living on sequence shards (norms, row-parallel biases)
before they are accumulated — so the data-parallel strategy and the optimizer see complete
gradients and the engine needs to know nothing of it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.placement import Placements

from ..comm import Comm
from .hf import check_hf_tp, hf_model_type, localize_config
from .hf_experts import apply_expert_tp
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPState,
    VocabParallelEmbedding,
)
from .loss import VocabParallelCrossEntropy
from .mappings import gather_from_sequence, scatter_to_sequence
from .plan import (
    HEAD_ATTRS,
    Plan,
    check_divisible,
    default_plan,
    fused_parts,
    is_layer_style,
    resolve,
)


def parallelize(model: nn.Module, mesh: ParallelMesh, comm: Comm, *, plan: Plan | None = None,
                sequence_parallel: bool = False, axis: str = "tp",
                placements: Placements | None = None) -> nn.Module:
    """Shard ``model`` over the mesh's ``axis`` following ``plan``; returns the same model.

    ``placements`` receives the record of every sharded or partial-gradient parameter, under
    its name in ``model`` (the engine passes its own; without it, sequence parallelism cannot
    complete the partial gradients).

    ``plan=None`` takes the model's own plan (``model.tp_plan()``) and raises ValueError for a
    model without one. Every check runs before any communication: the model's own shape checks
    (``model.check_tp(tp, sequence_parallel=...)`` when it has them, e.g. the GPT's ConfigError
    naming ``heads``, ``d-model``, ``ffn``, ``vocab-size`` or ``seq-len``), then the plan's
    styles, patterns, module kinds and divisibility (ConfigError naming ``tp``).
    """
    tp = mesh.size(axis)
    declared = plan is None
    if plan is None:
        plan = default_plan(model)
    check = getattr(model, "check_tp", None)
    if callable(check):
        check(tp, sequence_parallel=sequence_parallel)
    elif hf_model_type(model):
        check_hf_tp(model, tp)
        if sequence_parallel:       # the sequence split between the layers, from the model's plans
            from .hf_sequence import sequence_parallel_plan
            plan = {**plan, **sequence_parallel_plan(model, plan)}
    resolved = resolve(model, plan)
    check_divisible(resolved, tp)
    state = TPState(comm, axis, sequence_parallel)
    records = placements if placements is not None else Placements()
    for layers_first in (True, False):        # replace layers, then hook whatever is there now
        for name, _, styles in resolved:
            for style in styles:
                if is_layer_style(style) == layers_first:
                    _apply(model, name, model.get_submodule(name), style, state, records)
    if declared and hf_model_type(model):     # stacked experts: their declared styles
        apply_expert_tp(model, state, records, ep=mesh.size(Group.ep))
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    return new


def _apply(model: nn.Module, name: str, module: nn.Module, style: str, state: TPState,
           records: Placements) -> nn.Module:
    """Apply one style to the module at ``name``; returns the module now at that name."""
    sp = state.sequence_parallel
    new: ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding
    parts = fused_parts(style)
    if style in ("colwise", "vocab_head", "colwise_gather", "colwise_qkv") or parts is not None:
        new = ColumnParallelLinear.from_linear(module, state, gather_output=style == "colwise_gather",
                                               parts=3 if style == "colwise_qkv" else parts or 1)
    elif style in ("rowwise", "rowwise_split_input"):
        new = RowParallelLinear.from_linear(module, state,  # type: ignore[arg-type]
                                            input_is_parallel=style == "rowwise")
        if sp and new.bias is not None:      # added after the reduce-scatter: a chunk's grad
            records.mark(f"{name}.bias", tuple(new.bias.shape), partial_grad=True)
    elif style == "vocab_embedding":
        new = VocabParallelEmbedding.from_embedding(module, state)  # type: ignore[arg-type]
    elif style == "vocab_ce":
        ignore = getattr(module, "ignore_index", -100)
        return _replace(model, name, VocabParallelCrossEntropy(state, ignore_index=ignore))
    else:
        return _hook(module, style, state, records, name)
    records.add_prefix(name, new.placements)
    return _replace(model, name, new)


def _hook(module: nn.Module, style: str, state: TPState, records: Placements, name: str) -> nn.Module:
    """Apply a style that keeps the module: forward hooks, head counts, partial-grad records."""
    sp = state.sequence_parallel
    if style == "parallel_input":
        _enter_on_input(module, state)
    elif style == "local_heads":
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // state.size)     # this rank's heads (checked: divides)
        localize_config(module, state.size)
    elif style == "partial_grad":               # replicated, used on head shards: always partial
        for local, p in module.named_parameters():
            full = f"{name}.{local}" if name else local
            if p.requires_grad and not records.sharded(full):
                records.mark(full, tuple(p.shape), partial_grad=True)
    elif style == "sequence_parallel" and sp:
        for local, p in module.named_parameters():
            full = f"{name}.{local}" if name else local
            if p.requires_grad and not records.sharded(full):   # runs on a sequence chunk
                records.mark(full, tuple(p.shape), partial_grad=True)
    elif style == "sequence_scatter" and sp:
        module.register_forward_hook(
            lambda _m, _a, out: scatter_to_sequence(out, state.comm, state.axis))   # (b, s/n, h)
    elif style == "sequence_gather" and sp:
        module.register_forward_hook(
            lambda _m, _a, out: gather_from_sequence(out, state.comm, state.axis, partial_grad=False))
    elif style == "sequence_scatter_input" and sp:
        _on_input(module, lambda x: scatter_to_sequence(x, state.comm, state.axis))  # (b, s/n, h)
    return module


def _on_input(module: nn.Module, change: Callable[[torch.Tensor], torch.Tensor],
              style: str = "sequence_scatter_input") -> None:
    """``change`` the module's activation before it runs: its forward's first argument, given
    by position or by keyword (Hugging Face calls ``self_attn(hidden_states=...)``)."""
    first = next(iter(inspect.signature(module.forward).parameters), None)

    def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        by_keyword = not args and first in kwargs
        x = kwargs[first] if by_keyword else (args[0] if args else None)
        if not torch.is_tensor(x):
            raise TypeError(f"{style}: {type(m).__name__} must get its activation as its "
                            f"first argument ({first!r}, by position or keyword)")
        changed = change(x)
        if by_keyword:
            return args, {**kwargs, first: changed}
        return (changed, *args[1:]), kwargs

    module.register_forward_pre_hook(pre, with_kwargs=True)


def _enter_on_input(module: nn.Module, state: TPState) -> None:
    """The module's activation enters the region once (:func:`_on_input`); column layers
    inside skip f."""
    def enter(x: torch.Tensor) -> torch.Tensor:
        entered = x if state.inside_region else state.enter(x)   # (b, s, h)
        state.inside_region += 1
        return entered

    def post(_m: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        state.inside_region -= 1

    _on_input(module, enter, "parallel_input")
    module.register_forward_hook(post, always_call=True)
