"""The first decoder layer split by a tensor-parallel plan, against the unsplit layer, in one
process before any worker starts.

An inferred plan (:mod:`trainmesh.core.hf_infer`) or a user's plan file is a claim about the
model's code: that each column layer's output features are whole heads (or whole MLP
channels), that the row layer sums what the ranks computed. :func:`check_first_layer` tests the
claim on one batch. It gives the first decoder layer random weights (the model is on the meta
device: only that layer is built), runs the base model's own forward up to it (the token
embedding replaced by random hidden states, so the layer gets the position state, masks and
keyword arguments the model gives it) and records what each *unit* of the layer — a module
holding a row layer of the plan (the attention, the MLP) — takes and returns. Each unit is then
run once per TP rank with that rank's slices, as the parallel layers hold them:

==========================  ==================================================================
``colwise``                 the rank's rows of the weight (and bias): its output features
``colwise_parts:A,B,..``    the rank's rows of each block
``colwise_gather``          whole (its output gathered: every rank sees all of it)
``rowwise``                 the rank's columns of the weight; the bias on rank 0 only
``rowwise_split_input``     the same, on the rank's slice of a whole input
``local_heads``             the unit's head counts (and its config's) divided by tp
==========================  ==================================================================

and the ranks' outputs summed, as the row layer's all-reduce sums them. The sum must equal the
unsplit unit's output to float32 rounding: a sum of ``n`` products of magnitude ``s`` errs by
about ``sqrt(n)·eps·s`` (``n`` the row layer's input features, ``s`` the largest output),
``SAFETY`` times that for the few roundings stacked inside a unit. A projection split along the
wrong dimension fails by the size of the output itself, or cannot run: either is a ConfigError
naming ``--tp``, the unit and the difference. Imports core and models.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import base_name, layer_list, plan_source
from trainmesh.core.hf_plan import first_output, swapped

from .hf import hf_tp_plan, localize_config
from .plan import HEAD_ATTRS, fused_parts, resolve
from .state import shard_of

SAFETY = 64.0
"""Roundings stacked inside one unit (projections, softmax, the attention's sums) over the
one-sum estimate ``sqrt(n)·eps·s``; a wrong split errs by ~``s``, 1e4 times more at n ~ 1e3."""
SEED, BATCH, SEQ = 0, 2, 8


class _Stop(Exception):
    """Raised after the first layer: the rest of the model's forward is not needed."""


class _Hidden(nn.Module):
    """Stands in for the token embedding: random hidden states of its width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.weight = torch.empty(0, width)     # where a model looks for the device (Llama 4)

    def forward(self, ids: torch.Tensor, *_a: Any, **_k: Any) -> torch.Tensor:
        g = torch.Generator().manual_seed(SEED + 1)
        return torch.randn(*ids.shape, self.width, generator=g)               # (b, s, h)


class _StopLayer(nn.Module):
    def forward(self, *_a: Any, **_k: Any) -> Any:
        raise _Stop


def _real(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` with random float32 weights (buffers as built)."""
    g = torch.Generator().manual_seed(SEED)
    real = copy.deepcopy(layer)
    for module in real.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            t = torch.randn(p.shape, generator=g, dtype=torch.float32)
            t = t * 0.2 if p.dim() >= 2 else (1.0 + 0.1 * t if key == "weight" else 0.1 * t)
            module._parameters[key] = nn.Parameter(t, requires_grad=False)
    return real




def _record_units(model: nn.Module, real: nn.Module, units: list[str]) -> dict[str, tuple]:
    """{unit (its name in the layer): (args, kwargs, output)} of one forward of the base model
    reaching the first layer, that layer being ``real``."""
    base = base_name(model)
    root = model.get_submodule(base)
    layers = layer_list(model)
    embed = model.get_input_embeddings()
    embed_leaf = next(n for n, m in root.named_children() if m is embed)
    seen: dict[str, tuple] = {}
    hooks = []
    for unit in units:
        def pre(_m, args, kwargs, unit=unit):
            seen[unit] = (args, kwargs)

        def post(_m, _args, _kwargs, out, unit=unit):
            seen[unit] = (*seen[unit], first_output(out))
        module = real.get_submodule(unit)
        hooks += [module.register_forward_pre_hook(pre, with_kwargs=True),
                  module.register_forward_hook(post, with_kwargs=True)]
    stand_ins = nn.ModuleList([real, *(_StopLayer() for _ in root.get_submodule(layers)[1:])])
    ids = torch.randint(0, 2, (BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    try:
        hidden = _Hidden(embed.weight.shape[-1])
        with swapped(root, layers, stand_ins), swapped(root, embed_leaf, hidden):
            with torch.no_grad():
                try:
                    root(input_ids=ids, use_cache=False)
                except _Stop:
                    pass
    finally:
        for h in hooks:
            h.remove()
    return seen


class _Slice(nn.Module):
    """One rank's part of a ``nn.Linear`` under a plan style (module docstring)."""

    def __init__(self, linear: nn.Linear, style: str, rank: int, tp: int) -> None:
        super().__init__()
        w, b = linear.weight.detach(), linear.bias
        parts = fused_parts(style)
        self.split_input = style == "rowwise_split_input"
        self.rank, self.tp = rank, tp
        if style == "colwise" or parts is not None:
            self.weight = shard_of(w, 0, rank, tp, parts or 1)
            self.bias = None if b is None else shard_of(b.detach(), 0, rank, tp, parts or 1)
        elif style in ("rowwise", "rowwise_split_input"):
            self.weight = shard_of(w, 1, rank, tp)
            self.bias = None if b is None or rank else b.detach()
        else:                                    # colwise_gather: the whole output on every rank
            self.weight, self.bias = w, None if b is None else b.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = x.chunk(self.tp, dim=-1)[self.rank]                          # (.., in/tp)
        return F.linear(x, self.weight, self.bias)


def _rank_unit(unit: nn.Module, styles: dict[str, tuple[str, ...]], rank: int, tp: int) -> nn.Module:
    """``unit`` as TP rank ``rank`` holds it: its planned linears sliced, its head counts local.
    The copy shares the unit's parameters (a slice is a view of them), so checking a layer
    holds that layer's weights once, whatever ``tp``."""
    part = copy.deepcopy(unit, {id(p): p for p in unit.parameters()})
    for local, unit_styles in styles.items():
        layer_style = next((s for s in unit_styles if s.startswith(("colwise", "rowwise"))), None)
        if layer_style is not None and local:
            parent, _, leaf = local.rpartition(".")
            owner = part.get_submodule(parent) if parent else part
            setattr(owner, leaf, _Slice(owner.get_submodule(leaf), layer_style, rank, tp))
        if "local_heads" in unit_styles:
            module = part.get_submodule(local) if local else part
            for attr in HEAD_ATTRS:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, value // tp)
            localize_config(module, tp)
    return part


def check_first_layer(model: nn.Module, tp: int) -> None:
    """The first decoder layer split at ``tp`` by the model's tensor-parallel plan computes
    what the unsplit layer computes (module docstring); ConfigError naming ``--tp`` otherwise."""
    plan = hf_tp_plan(model)
    first = ".".join(p for p in (base_name(model), layer_list(model), "0") if p)
    styles = {name[len(first) + 1:]: s for name, _, s in resolve(model, plan)
              if name.startswith(first + ".")}
    units = sorted({local.rpartition(".")[0] for local, s in styles.items()
                    if any(x.startswith(("rowwise", "colwise")) for x in s) and "." in local})
    real = _real(model.get_submodule(first))
    seen = _record_units(model, real, units)
    kind = getattr(model.config, "model_type", type(model).__name__)
    source = plan_source(model, "tp") or "declared"
    for unit in units:
        args, kwargs, want = seen[unit]
        inside = {k[len(unit) + 1:]: s for k, s in styles.items() if k.startswith(unit + ".")}
        inside[""] = styles.get(unit, ())
        name = f"{first}.{unit}"
        split = [k for k, s in inside.items()
                 if any(x.startswith("colwise") and x != "colwise_gather" for x in s)]
        if split and not any(x.startswith("rowwise") for s in inside.values() for x in s):
            raise ConfigError("--tp", f"the {kind} family's {source} tensor-parallel plan splits "
                              f"the output features of {name}.{split[0]} but no row layer of "
                              f"{name} sums the ranks' parts: its output would stay split; valid "
                              "for it: --tp 1, or a plan of your own (--tp-plan FILE)")
        try:
            with torch.no_grad():
                parts = [_rank_unit(real.get_submodule(unit), inside, r, tp) for r in range(tp)]
                got = sum(first_output(part(*args, **kwargs)) for part in parts)
            err = float((got - want).abs().max())
        except (RuntimeError, ValueError, IndexError) as exc:
            raise ConfigError("--tp", f"the {kind} family's {source} tensor-parallel plan cannot "
                              f"split {name} over {tp} ranks: {str(exc).splitlines()[0]}; valid "
                              "for it: --tp 1, or a plan of your own (--tp-plan FILE)") from None
        rows = [m for k, m in real.get_submodule(unit).named_modules()
                if any(x.startswith("rowwise") for x in inside.get(k, ()))]
        n = max((m.in_features for m in rows), default=1)
        scale = max(float(want.abs().max()), 1.0)
        bound = SAFETY * math.sqrt(n) * torch.finfo(torch.float32).eps * scale
        if not err <= bound:
            raise ConfigError("--tp", f"the {kind} family's {source} tensor-parallel plan does not "
                              f"reproduce the unsplit first layer: {name} split over {tp} ranks "
                              f"differs by {err:.3g} (float32 rounding allows {bound:.3g}); valid "
                              "for it: --tp 1, or a plan of your own (--tp-plan FILE)")
