"""A Hugging Face model's parallel plans: the ones it declares, a user's plan files, or plans
inferred from its modules — installed in its config, where every axis reads them.

transformers keeps a model's plans in its config (``base_model_tp_plan``,
``base_model_pp_plan``, ``base_model_ep_plan``; patterns relative to the base model) and the
pipeline plan with the head in the model (``model.pp_plan``). :func:`install_plans` decides,
per axis, which plan the model trains with:

1. a plan file (``--tp-plan FILE``, ``--pp-plan FILE``, ``--ep-plan FILE``): JSON in the
   config's own format — ``{"layers.*.self_attn.q_proj": "colwise", ...}`` for tp and ep,
   ``{"embed_tokens": [["input_ids"], ["inputs_embeds"]], "layers": [["hidden_states",
   "attention_mask"], ["hidden_states"]], "norm": [["hidden_states"], ["hidden_states"]]}``
   for pp (the decoder layer list among them) — which overrides what the model declares;
2. the plan the model declares;
3. a plan inferred from its modules (:mod:`trainmesh.core.hf_infer`) where it declares none
   (or, for pp, one without a layer list).

It records where each came from and, where inference failed, what it could not place, in the
model's :class:`~trainmesh.core.hub_state.HubState` (read by
:func:`~trainmesh.core.hf_infer.plan_source`, :func:`~trainmesh.core.hf_infer.not_inferred`),
which the refusals of the axes name. A plan file that is not
a JSON object of the config's format, or names no module of the model, is a ConfigError naming
its flag and what is wrong. Imports core only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from torch import nn

from trainmesh.core.errors import ConfigError
from trainmesh.core.hf_infer import (
    AXES,
    HEAD_IO,
    Uninferable,
    base_name,
    infer_ep_plan,
    infer_pp_plan,
    infer_tp_plan,
)
from trainmesh.core.hf_plan import declared_pp_plan
from trainmesh.core.hub_state import hub_state

FLAGS = {"tp": "--tp-plan", "pp": "--pp-plan", "ep": "--ep-plan"}
FIELDS = {"tp": "base_model_tp_plan", "pp": "base_model_pp_plan", "ep": "base_model_ep_plan"}
FORMATS = {"tp": 'a JSON object of module pattern -> style, e.g. {"layers.*.self_attn.q_proj": '
                 '"colwise", "layers.*.self_attn.o_proj": "rowwise"}',
           "ep": 'a JSON object of pattern -> style, e.g. {"layers.*.mlp.experts": '
                 '"ep_dispatch_experts", "layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}',
           "pp": 'a JSON object of the base model\'s modules in data-flow order -> [inputs, '
                 'outputs], e.g. {"embed_tokens": [["input_ids"], ["inputs_embeds"]], "layers": '
                 '[["hidden_states", "attention_mask"], ["hidden_states"]], "norm": '
                 '[["hidden_states"], ["hidden_states"]]}'}


@dataclass(frozen=True)
class PlanFiles:
    """The user's plan files, per axis (None: the model's own or an inferred plan)."""

    tp: str | None = None
    pp: str | None = None
    ep: str | None = None


def read_plan_file(path: str, axis: str) -> dict[str, Any]:
    """The plan of ``path`` for ``axis`` (tp, pp or ep), in the config's format; ConfigError
    naming its flag when the file cannot be read or is not that format."""
    flag = FLAGS[axis]

    def bad(what: str) -> ConfigError:
        return ConfigError(flag, f"{path}: {what}; valid: {FORMATS[axis]}")

    try:
        plan = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {path!r}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(plan, dict) or not plan:
        raise bad(f"a {type(plan).__name__}{' (empty)' if not plan else ''}, not a plan")
    for key, value in plan.items():
        if axis != "pp" and not isinstance(value, str):
            raise bad(f"{key!r} maps to {value!r}, not a style (a string)")
        if axis == "pp" and not (isinstance(value, list) and len(value) == 2 and all(
                isinstance(part, list) and all(isinstance(n, str) for n in part) for part in value)):
            raise bad(f"{key!r} maps to {value!r}, not [inputs, outputs] (two lists of names)")
    if axis == "pp":
        return {key: (value[0], value[1]) for key, value in plan.items()}
    return plan


def _unmatched(model: nn.Module, plan: dict[str, Any]) -> list[str]:
    """Patterns of ``plan`` (relative to the base model) matching no module or parameter."""
    base = base_name(model)
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    full = {p: f"{base}.{p}" if base else p for p in plan}
    return [p for p, f in full.items() if not any(fnmatchcase(n, f) for n in names)]


def _declares(model: nn.Module, axis: str) -> bool:
    config = getattr(model, "config", None)
    if axis == "tp":
        return bool(getattr(config, FIELDS["tp"], None)) or getattr(config, "model_type", "") == "gpt2"
    if axis == "ep":
        return bool(getattr(config, FIELDS["ep"], None))
    plan = declared_pp_plan(model) or {}
    modules = dict(model.named_modules())
    return any(isinstance(modules.get(name), nn.ModuleList) for name in plan)


def _set(model: nn.Module, axis: str, plan: dict[str, Any]) -> None:
    setattr(model.config, FIELDS[axis], plan)
    if axis == "pp":
        base = base_name(model)
        whole = {f"{base}.{n}" if base else n: io for n, io in plan.items()}
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        whole.update({n: HEAD_IO for n, m in model.named_modules() if head is not None and m is head})
        model.pp_plan = whole


def _infer(model: nn.Module, axis: str) -> dict[str, Any]:
    if axis == "tp":
        return infer_tp_plan(model)
    if axis == "ep":
        return infer_ep_plan(model)
    return infer_pp_plan(model)[0]


def install_plans(model: nn.Module, files: PlanFiles | None = None) -> nn.Module:
    """Per axis: the plan file's plan, else the declared one, else one inferred from the
    modules, in the model's config (module docstring); returns ``model``."""
    sources: dict[str, str] = {}
    uninferred: dict[str, str] = {}
    for axis in AXES:
        path = getattr(files, axis, None) if files is not None else None
        if path:
            plan = read_plan_file(path, axis)
            unmatched = _unmatched(model, plan)
            if unmatched:
                raise ConfigError(FLAGS[axis], f"{path}: {unmatched[0]!r} names no module or "
                                  f"parameter of the {getattr(model.config, 'model_type', '')} "
                                  f"model (patterns are relative to its base model: "
                                  f"{_sample(model)}, ...)")
            _set(model, axis, plan)
            sources[axis] = "file"
        elif _declares(model, axis):
            sources[axis] = "declared"
        else:
            try:
                _set(model, axis, _infer(model, axis))
                sources[axis] = "inferred"
            except Uninferable as exc:
                uninferred[axis] = str(exc)
    state = hub_state(model)
    state.plan_sources, state.uninferred = sources, uninferred
    if sources.get("pp") == "file":
        from trainmesh.core.hf_plan import hf_structure
        hf_structure(model, FLAGS["pp"])
    return model


def _sample(model: nn.Module) -> str:
    base = base_name(model)
    names = [n[len(base) + 1:] if base else n for n, _ in model.named_modules()
             if n.startswith(f"{base}.") or (not base and n)]
    return ", ".join(names[:4])
